"""Rank 0's driver: requests in, scheduled steps out to the executor, per-request outputs back."""
import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
from itertools import count

import msgspec
from tqdm.auto import tqdm

from tpengine.config import EngineConfig
from tpengine.engine.detokenizer import Detokenizer
from tpengine.engine.draft_policy import DraftPolicy
from tpengine.engine.inputs import images_of, parse_prompt, per_prompt, prompt_list
from tpengine.engine.lora_slots import LoRASlots
from tpengine.engine.prompt_logprob_cache import PromptLogprobCache
from tpengine.engine.proposer import make_proposer
from tpengine.engine.request import POOLED, PoolingRequest, Request, StepReports
from tpengine.engine.scheduler import Scheduler
from tpengine.engine.sequence import Sequence, SequenceStatus
from tpengine.engine.step_plan import StepPlan
from tpengine.engine.virtual_engines import VirtualEngines
from tpengine.errors import InvalidRequestError
from tpengine.families import FAMILIES
from tpengine.gguf import is_gguf
from tpengine.lora.checks import LoRAAdapterChecks
from tpengine.lora.request import LoRARequest
from tpengine.multimodal.prompt import MultiModalPrompt, image_prompts_for
from tpengine.hf_config import (every_layer_slides, load_eos_token_ids, load_hf_config, long_rope_threshold_of,
                                sliding_window_of)
from tpengine.outputs import (NO_TOKEN, ClassificationOutput, ClassificationRequestOutput, EmbeddingRequestOutput,
                              RequestOutput, ScoringRequestOutput, merge_deltas)
from tpengine.pooling import classifier_token_ids, read_pooling_config
from tpengine.sampling_params import PoolingParams, SamplingParams
from tpengine.scoring import classifier_scores, cosine_scores, pair_prompt, score_pairs
from tpengine.structured.limits import check_min_tokens_reachable
from tpengine.thinking import THINK_END, THINK_START, thinking_open_after

logger = logging.getLogger("tpengine")

# With only requests whose grammars compile, a step waits this long for one before it returns (and the
# caller, a server's engine thread, takes new commands).
AWAIT_GRAMMAR_S = 0.05


def load_tokenizer(model: str, tokenizer: str | None):
    """The model's tokenizer (None where its folder has none), or the folder tokenizer names (--tokenizer)."""
    if tokenizer is None and is_gguf(model):  # the tokenizer the file holds
        from tpengine.gguf.tokenizer import load_gguf_tokenizer
        return load_gguf_tokenizer(model)
    names = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    if not any(os.path.exists(os.path.join(tokenizer or model, name)) for name in names):
        if tokenizer is not None:
            raise ValueError(f"tokenizer={tokenizer!r} is not a folder with a Hugging Face tokenizer (none of {names})")
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tokenizer or model)


def text_only_reason(model: str, hf_config, config: EngineConfig) -> str | None:
    """None where the model reads images; else why not, as the tail of an error ("" for a text model). Gemma 3's
    image-text checkpoints serve their text model alone without a vision tower or an image processor, with pipeline
    stages or with speculative decoding (other image families refuse those settings: EngineConfig)."""
    family = FAMILIES[hf_config.model_type]
    if not family.images:
        return ""
    if family.bidirectional_images:
        if not hf_config.vision_config:  # transformers would build SigLIP's defaults, which cannot pool to its tokens
            return " (its config.json has no vision_config)"
        if not os.path.isfile(os.path.join(model, "preprocessor_config.json")):
            return " (its folder has no preprocessor_config.json)"
        if config.pipeline_parallel_size > 1 or config.speculative_config is not None:
            return " with pipeline_parallel_size > 1 or speculative decoding"
    return None


class LLMEngine:
    def __init__(self, model: str | os.PathLike, **kwargs):
        model = os.fspath(model)
        config = EngineConfig(model=model, **kwargs)
        hf_config = load_hf_config(model, config.hf_overrides)
        # what the model decides (max_model_len, ...) is resolved once here: the ledger and every rank read it
        config = config.resolve(hf_config)
        self.config = config
        self.vocab_size = hf_config.vocab_size
        self.max_model_len = config.max_model_len
        self.tokenizer = load_tokenizer(model, config.tokenizer)
        eos_token_ids = load_eos_token_ids(model, hf_config)  # read before any worker starts: it may raise
        self.detokenizer = None if self.tokenizer is None else Detokenizer(self.tokenizer, self.vocab_size)
        # before any worker starts: it may raise
        # (<think>, </think>): where structured outputs start in a reasoning model's completions (tpengine/thinking.py)
        self.reasoning_tokens = None if config.reasoning_parser is None else self._reasoning_tokens()
        # an image model's processor: a request's images are read and checked here, before it is queued
        self.text_only_reason = text_only_reason(model, hf_config, config)
        self.images = image_prompts_for(model, hf_config, config.images_per_prompt, self.tokenizer) \
            if self.text_only_reason is None else None
        if hf_config.classifier_from_token is not None:  # every rank reads them: a missing one is told here, once
            classifier_token_ids(config.tokenizer or model, hf_config.classifier_from_token)
        if config.world_size > 1:
            from tpengine.runner.multiproc_executor import MultiprocExecutor
            self.executor = MultiprocExecutor(config)
        else:
            from tpengine.runner.executor import Executor
            self.executor = Executor(config)
        try:
            # what the ranks measured fills in the rest: the config logged is the one that runs
            config = self.config = msgspec.structs.replace(
                config, num_kvcache_blocks=self.executor.num_kvcache_blocks,
                max_num_batched_tokens=self.executor.max_num_batched_tokens)
            for line in config.describe():
                logger.info("config %s", line)
            self.scheduler = self._make_ledger(config, hf_config, eos_token_ids)
        except BaseException:  # workers run from here on: nothing may leave them behind
            self.executor.shutdown()
            raise
        self._request_ids = count()
        self._requests: dict[int, Request] = {}
        self._num_per_step_requests = 0     # live requests that need work every step (text, stops, logprobs)
        # reports the next step() hands out first (generate's for others' requests, aborts'), by request id
        self._pending: dict[int, tuple[Request, object]] = {}
        # structured outputs: the grammar compiler (made on first use), requests queued once their grammar is
        # compiled, and how many live requests have one
        self._grammar_compiler = None
        self._grammar_compiler_lock = threading.Lock()  # a server's renderer thread may make it first
        self._awaiting_grammar: list[Request] = []
        self._num_constrained_requests = 0
        self.prompt_tokens_total = 0        # prompt tokens computed (prefix-cache hits excluded)
        self._lora_adapters = LoRAAdapterChecks(config, hf_config)  # adapters requests may name, checked once
        self.pooling = read_pooling_config(model, hf_config)  # how embedding requests pool (pooling.py)
        self.hidden_size = hf_config.hidden_size

    def _make_ledger(self, config: EngineConfig, hf_config, eos_token_ids: frozenset[int]) -> VirtualEngines:
        """The schedulers (a pipeline keeps steps in flight, each from its own: engine/virtual_engines.py; one stage:
        a single scheduler, one step at a time) with what they share: the LoRA slots, the kept prompt logprobs (as
        many blocks' as the KV cache holds)."""
        spec = config.speculative_config
        self.lora_slots = LoRASlots(config.max_loras) if config.enable_lora else None
        self.prompt_logprob_cache = PromptLogprobCache(config.num_kvcache_blocks)
        return VirtualEngines(
            config.max_steps_in_flight,
            num_kvcache_blocks=config.num_kvcache_blocks, kvcache_block_size=config.kvcache_block_size,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len, eos_token_ids=eos_token_ids,
            enable_prefix_caching=config.enable_prefix_caching, scheduling_policy=config.scheduling_policy,
            proposer=None if spec is None else make_proposer(spec),
            num_speculative_tokens=0 if spec is None else spec.num_speculative_tokens,
            draft_policy=None if spec is None else DraftPolicy(spec.disable_by_batch_size, spec.adaptive),
            sliding_window=self._ledger_window(hf_config), long_rope_threshold=long_rope_threshold_of(hf_config),
            lora_slots=self.lora_slots, prompt_logprobs=self.prompt_logprob_cache)

    # --- metrics (cheap: read by a server every scrape) ---------------------------------------------

    @property
    def num_requests_running(self) -> int:
        """Completions being decoded (each of a request's n counts)."""
        return len(self.scheduler.running)

    @property
    def num_requests_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV-cache blocks in use, 0..1."""
        return self.scheduler.kv_cache_usage

    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache so far."""
        return self.scheduler.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        """Of those, the tokens whose K/V came from the cache instead of being computed."""
        return self.scheduler.prefix_cache_hits

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def generation_tokens_total(self) -> int:
        """Tokens sampled into sequences (a verify row's accepted drafts included)."""
        return self.scheduler.num_output_tokens

    @property
    def spec_decode_stats(self) -> dict[str, int | list[int]] | None:
        """Speculative decoding's counters (vLLM's spec_decode_* names), None without speculation: verify
        rows with drafts, drafts, accepted drafts, and accepted drafts by position in their row."""
        scheduler = self.scheduler
        if scheduler.proposer is None:
            return None
        return dict(num_drafts=scheduler.num_drafts, num_draft_tokens=scheduler.num_draft_tokens,
                    num_accepted_tokens=scheduler.num_accepted_tokens,
                    num_accepted_tokens_per_pos=list(scheduler.num_accepted_tokens_per_pos))

    @property
    def max_request_len(self) -> int:
        """Most tokens (prompt + output) one request can reach: max_model_len, or the whole cache if smaller."""
        manager = self.scheduler.block_manager
        return min(self.max_model_len, manager.num_blocks * manager.block_size)

    def _ledger_window(self, hf_config) -> int | None:
        """The window behind which the ledger releases blocks: where every layer of the model (and of its
        draft model, which shares its blocks) slides, the longest of their windows; else None."""
        configs = [hf_config]
        spec = self.config.speculative_config
        if spec is not None and spec.method == "draft_model":
            configs.append(load_hf_config(spec.model))
        if not all(every_layer_slides(config) for config in configs):
            return None
        return max(sliding_window_of(config) for config in configs)

    def _reasoning_tokens(self) -> tuple[int, int]:
        """The tokens that open and end a reasoning model's thinking (structured outputs constrain the answer)."""
        vocab = {} if self.tokenizer is None else self.tokenizer.get_vocab()
        missing = [tag for tag in (THINK_START, THINK_END) if tag not in vocab]
        if missing:
            raise ValueError(f"reasoning_parser={self.config.reasoning_parser!r} needs a tokenizer with the "
                             f"{THINK_START} and {THINK_END} tokens; this model folder's has no {' or '.join(missing)}")
        return vocab[THINK_START], vocab[THINK_END]

    def _may_think(self, params: SamplingParams, prompt_token_ids: list[int]) -> bool:
        """Whether a completion may think before its answer (tpengine/thinking.py's rule)."""
        if self.reasoning_tokens is None:
            return False
        return params.may_open_thinking or thinking_open_after(prompt_token_ids, *self.reasoning_tokens)

    @property
    def grammar_compiler(self):
        """The structured-outputs grammar compiler for this model's tokenizer (made on first use)."""
        with self._grammar_compiler_lock:
            if self._grammar_compiler is None:
                if self.tokenizer is None:
                    raise InvalidRequestError("structured outputs need a tokenizer, and this model folder has none",
                                              "structured_outputs")
                from tpengine.structured.compiler import GrammarCompiler
                self._grammar_compiler = GrammarCompiler.for_tokenizer(self.tokenizer, self.vocab_size,
                                                                       self.scheduler.eos_token_ids)
            return self._grammar_compiler

    def check_health(self) -> None:
        """Raise if a worker is gone; between steps nothing else would notice."""
        self.executor.check_health()

    # --- requests -------------------------------------------------------------------------------

    def _make_request(self, prompt, sampling_params: SamplingParams | PoolingParams | None, stream: bool,
                      wait_for_grammar: bool = True, lora_request: LoRARequest | None = None) -> Request:
        """Validate one request and build it; nothing is queued (so a bad one leaves no trace). wait_for_grammar:
        a grammar is compiled before this returns (a rejected or too slow one is this request's ValueError); else
        the request waits unscheduled for it. PoolingParams: an embedding request."""
        if isinstance(sampling_params, PoolingParams):
            return self._make_pooling_request(prompt, sampling_params, lora_request)
        if self.config.runner == "pooling":
            raise InvalidRequestError("this engine was made with runner='pooling' (task='embed', or a classifier's): "
                                      "it embeds or scores, it does not generate", "model")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        params = sampling_params
        self._check_sampling_params(params)
        if lora_request is not None:
            self._lora_adapters.check(lora_request)
        prompt, token_ids, multimodal = self._prompt_tokens(prompt, params.max_tokens)
        block_size = self.config.kvcache_block_size
        request_id = next(self._request_ids)
        seqs = [Sequence(token_ids, params, block_size=block_size, request_id=request_id, lora=lora_request,
                         multimodal=multimodal)]
        for i in range(1, params.n):  # child i samples with seed + i: reproducible, and distinct from its siblings
            child_params = params if params.seed is None else dataclasses.replace(params, seed=params.seed + i)
            seqs.append(Sequence(token_ids, child_params, block_size=block_size, index=i, parent=seqs[0],
                                 request_id=request_id, lora=lora_request, multimodal=multimodal))
        request = Request(request_id, prompt, token_ids, params, seqs, self.detokenizer, stream)
        if params.structured_outputs is not None:
            spec = params.structured_outputs
            if params.min_tokens and not self._may_think(params, token_ids):  # thinking tokens would count too
                try:
                    check_min_tokens_reachable(spec.kind, getattr(spec, spec.kind), params.min_tokens)
                except ValueError as e:
                    raise InvalidRequestError(str(e), "min_tokens") from None
            compiler = self.grammar_compiler
            request.grammar = compiler.compile(params.structured_outputs)  # on the compiler's threads
            if wait_for_grammar:
                compiler.wait(request.grammar, params.structured_outputs)
        return request

    def _check_sampling_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: limits of this engine, its vocabulary and tokenizer."""
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer, and this model folder has none: use "
                                      "stop_token_ids", "stop")
        if params.prompt_logprobs is not None and self.config.pipeline_parallel_size > 1:
            raise InvalidRequestError("prompt_logprobs run on one pipeline stage: use pipeline_parallel_size=1",
                                      "prompt_logprobs")
        if params.n > self.config.max_num_seqs:
            raise InvalidRequestError(f"n={params.n} is more than max_num_seqs={self.config.max_num_seqs}", "n")
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise InvalidRequestError(f"logprobs={params.logprobs} is more than the vocabulary's {self.vocab_size} "
                                      "tokens", "logprobs")
        for name, what, ids in (("stop_token_ids", "stop token id", params.stop_token_ids),
                                ("logit_bias", "logit_bias token id", params.logit_bias or ())):
            for t in ids:
                if t >= self.vocab_size:
                    raise InvalidRequestError(f"{what} {t} is outside the vocabulary [0, {self.vocab_size})", name)

    def _prompt_tokens(self, prompt, max_tokens: int,
                       keep_last: int | None = None) -> tuple[str | list[int], list[int], MultiModalPrompt | None]:
        """A prompt as (what the user gave, its token ids: the last keep_last of them, if given; its images placed,
        if it has any), checked against the vocabulary and, with max_tokens after it, the engine's limits.
        InvalidRequestError naming the prompt."""
        try:
            prompt_dict, images = prompt, images_of(prompt)
            if images and self.images is not None and isinstance(prompt.get("prompt"), str):
                # its image placeholders written out as the model's processor writes them, then tokenized
                text = prompt["prompt"]
                _, token_ids = parse_prompt({**prompt, "prompt": self.images.expand_text(text)}, self.tokenizer)
                prompt = text
            else:
                prompt, token_ids = parse_prompt(prompt, self.tokenizer)
            if not token_ids:
                raise ValueError("prompt is empty: it needs at least one token")
            if keep_last is not None:
                token_ids = token_ids[-keep_last:]
            for t in token_ids:
                if not 0 <= t < self.vocab_size:
                    raise ValueError(f"prompt token id {t!r} is outside the vocabulary [0, {self.vocab_size})")
            multimodal = None
            processor_kwargs = prompt_dict.get("mm_processor_kwargs") if isinstance(prompt_dict, dict) else None
            if self.images is not None:
                token_ids, multimodal = self.images.place(token_ids, images, processor_kwargs)
            elif images or processor_kwargs is not None:
                raise ValueError(f"this model ({self.config.model}) reads no images{self.text_only_reason}: "
                                 "multi_modal_data and mm_processor_kwargs need an image model (Qwen2.5-VL, "
                                 "Qwen3-VL, Gemma 3)")
            if multimodal is not None and multimodal.whole_images:
                self._check_whole_images(multimodal)
            self.scheduler.check_fits(len(token_ids), max_tokens)
        except InvalidRequestError:
            raise
        except ValueError as e:  # the prompt, or its length with max_tokens, is at fault
            raise InvalidRequestError(str(e), "prompt") from None
        return prompt, token_ids, multimodal

    def _check_whole_images(self, multimodal: MultiModalPrompt) -> None:
        """A step computes all of an image's tokens when they attend to each other both ways (Gemma 3)."""
        limit = self.config.max_num_batched_tokens
        for i, placement in enumerate(multimodal.images):
            if placement.image.num_tokens > limit:
                raise ValueError(f"image {i} takes {placement.image.num_tokens} tokens, more than "
                                 f"max_num_batched_tokens={limit}: this model computes an image's tokens in one step")

    def _make_pooling_request(self, prompt, params: PoolingParams, lora_request: LoRARequest | None) -> Request:
        """An embedding request: its prompt (its last truncate_prompt_tokens, if asked) computed and pooled."""
        if self.config.pipeline_parallel_size > 1:
            raise InvalidRequestError("embeddings run on one pipeline stage: use pipeline_parallel_size=1", "model")
        if lora_request is not None:
            self._lora_adapters.check(lora_request)
        spec = self.pooling.checked(params, self.hidden_size)
        keep = None if params.truncate_prompt_tokens is None else \
            self.max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
        prompt, token_ids, multimodal = self._prompt_tokens(prompt, 0, keep)
        request_id = next(self._request_ids)
        seq = Sequence(token_ids, POOLED, block_size=self.config.kvcache_block_size, request_id=request_id,
                       lora=lora_request, multimodal=multimodal)
        seq.pooling, seq.prompt_only = spec, True
        seq.reuse_limit = 0 if self.pooling.reads_every_token else None
        return PoolingRequest(request_id, prompt, token_ids, POOLED, [seq], self.detokenizer, False)

    def _queue(self, request: Request) -> None:
        self._requests[request.request_id] = request
        self._num_per_step_requests += request.per_step
        if request.grammar is None:
            for seq in request.seqs:
                self.scheduler.add(seq)
            return
        self._num_constrained_requests += 1
        if request.grammar.done():  # compiled before (a cached grammar)
            self._admit_compiled(request)
        else:  # it waits unscheduled; nobody else waits for it
            self._awaiting_grammar.append(request)

    def _admit_compiled(self, request: Request) -> None:
        """Queue a request whose grammar is compiled, each completion with its own matcher."""
        from tpengine.structured.matcher import SequenceGrammar
        compiled = request.grammar.result()
        for seq in request.seqs:
            self.scheduler.add(seq)
            seq.sampling.grammar = SequenceGrammar(compiled, self.reasoning_tokens, request.prompt_token_ids,
                                                   request.params.may_open_thinking, self.grammar_compiler.utf8_guard)

    def _admit_awaiting(self, wait_s: float) -> None:
        """Queue the requests whose grammars are compiled, waiting up to wait_s for one when nothing else runs."""
        if wait_s > 0:
            concurrent.futures.wait([r.grammar for r in self._awaiting_grammar], timeout=wait_s,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        still = []
        for request in self._awaiting_grammar:
            if not request.grammar.done():
                still.append(request)
            elif request.grammar.exception() is not None:  # not waited for, and failed to compile: it ends
                logger.error("request %d: its grammar failed to compile: %s", request.request_id,
                             request.grammar.exception())
                self._report_later(request, self._finish_unqueued(request, NO_TOKEN))
            else:
                self._admit_compiled(request)
        self._awaiting_grammar = still

    def add_request(self, prompt, sampling_params: SamplingParams | None = None, *, stream: bool = True,
                    wait_for_grammar: bool = True, lora_request: LoRARequest | None = None) -> int:
        """Queue one request; returns its id. Raises ValueError (and queues nothing) for bad input.
        lora_request: the LoRA adapter it runs with (the engine made with enable_lora=True).
        step() reports it every step it gets a token (stream=True), or once, when it finishes.
        wait_for_grammar=False (a server that compiled it already): a grammar still compiling does not hold up
        the caller; the request waits unscheduled for it, and ends with finish_reason "error" if it fails."""
        request = self._make_request(prompt, sampling_params, stream, wait_for_grammar, lora_request)
        self._queue(request)
        return request.request_id

    # --- LoRA adapters (vLLM's names) ------------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Check an adapter now (ValueError if it cannot run), so requests naming it need no reading of its files."""
        self._lora_adapters.check(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter: its slot frees once the requests running with it finish. False if it was not known."""
        if not self._lora_adapters.forget(lora_int_id):
            return False
        self.lora_slots.forget_adapter(lora_int_id)
        return True

    def list_loras(self) -> set[int]:
        return set(self._lora_adapters.checked)

    def abort(self, request_id: int, *, build: bool = True) -> RequestOutput | None:
        """Stop a request now; returns its final output (the next step() reports it too), or None if it is not live.
        build=False (step_reports()'s caller): nothing is built or returned here; the next step_reports() holds it."""
        aborted = self._abort(request_id)
        if aborted is None:
            return None
        request, item = aborted
        if not build:
            self._report_later(request, item)
            return None
        output = request.build(item)
        self._report_later(request, output)
        return output

    def _abort(self, request_id: int) -> tuple[Request, object] | None:
        request = self._requests.get(request_id)
        if request is None:
            return None
        if self.scheduler.in_flight and not self.executor.closed:
            self._drain_pipeline()  # a sequence in a step in flight leaves the ledger only once that step is back
            request = self._requests.get(request_id)
            if request is None:  # it finished in those steps
                return None
        if request in self._awaiting_grammar:  # never queued: its grammar is still compiling
            self._awaiting_grammar.remove(request)
            return request, self._finish_unqueued(request)
        for seq in request.seqs:
            if not seq.is_finished and self.scheduler.abort(seq.seq_id) is not None:
                request.on_finish(seq)
        self._forget(request)
        return request, request.report()

    def _finish_unqueued(self, request: Request, reason: str = "abort"):
        """End a request none of whose completions was queued (its grammar never compiled, or it was
        aborted meanwhile)."""
        for seq in request.seqs:
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
            request.on_finish(seq)
        self._forget(request)
        return request.report()

    def _forget(self, request: Request) -> None:
        """A finished or aborted request leaves the engine's books."""
        del self._requests[request.request_id]
        self._num_per_step_requests -= request.per_step
        self._num_constrained_requests -= request.grammar is not None

    def live_request_ids(self) -> list[int]:
        """The ids of the requests not yet finished or aborted."""
        return list(self._requests)

    def has_unfinished_requests(self) -> bool:
        return not self.scheduler.is_finished() or bool(self._pending) or bool(self._awaiting_grammar)

    # --- steps ----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step. Returns a RequestOutput for every request that got a token, finished or
        was aborted since the last step() (finished=True on its last one): everything so far, or only what
        is new for a request whose output_kind is DELTA."""
        return self.step_reports().build()

    def step_reports(self) -> StepReports:
        """step(), its outputs not yet built: StepReports.build() makes them, on any one thread, in the order of
        the steps. A server's engine thread steps on while its event loop builds them."""
        reports, _ = self._step()
        if not self._pending:
            return StepReports(reports, unique=True)
        pending, self._pending = self._pending, {}
        return StepReports([*pending.values(), *reports], unique=False)

    def _report_later(self, request: Request, item) -> None:
        """Hold a report for the next step(): a newer one of a plain stream, or a newer cumulative output, stands
        for all before it (a plain stream's is built from what it has reported so far); delta outputs are joined."""
        older = self._pending.get(request.request_id)
        self._pending[request.request_id] = (request, item) if older is None or request.plain_stream or \
            not request.delta else (request, merge_deltas(older[1], item))

    def _step(self) -> tuple[list[tuple[Request, object]], StepPlan | None]:
        """One step; its reports (Request.report, with their requests) and its plan (None when nothing was queued)."""
        if self._awaiting_grammar:  # wait a moment for a grammar only when nothing else could run
            self._admit_awaiting(AWAIT_GRAMMAR_S if self.scheduler.is_finished() else 0.0)
        return self._run_steps(self.scheduler)

    def _run_steps(self, engines: VirtualEngines) -> tuple[list[tuple[Request, object]], StepPlan | None]:
        """Every virtual engine without a step in flight submits its next one (a pipeline: so each stage has a
        step to run; one stage: the one step runs), then the oldest step's tokens are collected and accounted
        for."""
        self.executor.check_open()
        try:
            for scheduler in engines.idle():
                started, num_output_tokens = time.perf_counter(), scheduler.num_output_tokens
                plan = scheduler.schedule()
                if plan:
                    self.executor.submit(plan)
                    engines.in_flight.append((scheduler, plan, started, num_output_tokens))
            if not engines.in_flight:
                # only requests that fit the cache alone are added (check_fits): with work queued something runs
                assert engines.is_finished(), "queued requests but nothing schedulable"
                return [], None
            scheduler, plan, started, num_output_tokens = engines.in_flight[0]
            sampled = self.executor.collect(plan)
            engines.in_flight.popleft()
        except BaseException:
            # steps in flight no ledger can account for: the executor forgets them (a worker group stops every
            # rank, as a failed step does; rank 0 alone goes on: its scheduler undoes the step when it next runs)
            engines.in_flight.clear()
            self.executor.abandon()
            raise
        return self._finish_step(scheduler, plan, sampled, started, num_output_tokens), plan

    def _drain_pipeline(self) -> None:
        """Account for every step in flight (before an abort changes the ledger they were scheduled from);
        their outputs go out with the next step()."""
        engines = self.scheduler
        while engines.in_flight:
            scheduler, plan, started, num_output_tokens = engines.in_flight[0]
            try:
                sampled = self.executor.collect(plan)
            except BaseException:
                engines.in_flight.clear()
                self.executor.abandon()
                raise
            engines.in_flight.popleft()
            for request, item in self._finish_step(scheduler, plan, sampled, started, num_output_tokens):
                self._report_later(request, item)

    def _finish_step(self, scheduler: Scheduler, plan: StepPlan, sampled, started: float,
                     num_output_tokens: int) -> list[tuple[Request, object]]:
        """Append a step's sampled tokens to its sequences and report them (Request.report)."""
        self.prompt_tokens_total += plan.num_prefill_tokens
        # seqs: decode rows and prompts, one sampled row each, then verify rows; logprobs[i] is seqs[i]'s row
        # for the first ones, and None for a verify row's sequence (no request with logprobs speculates)
        if sampled.prompt_logprobs:  # before postprocess: the step's sequences are still its scheduled ones
            self._take_prompt_logprobs(scheduler, sampled.prompt_logprobs)
        seqs, finished = scheduler.postprocess(plan, sampled.token_ids, sampled.draft_token_ids)
        scheduler.observe_step(plan, scheduler.num_output_tokens - num_output_tokens, time.perf_counter() - started)
        if self._num_constrained_requests:
            finished = finished + self._advance_grammars(seqs)
        touched: dict[int, Request] = {}
        if sampled.pooled:  # embeddings: their prompts ran to the end, no token
            finished = self._take_pooled(finished, sampled.pooled, touched)
        reports: list[tuple[Request, object]] = []
        if self._num_per_step_requests:
            self._process_tokens(seqs, sampled.logprobs, touched, reports)
            for seq in finished:
                if seq.prompt_only:  # a scored prompt's end: no token, so not among seqs
                    self._process_finished(seq, touched)
        else:  # no request reads anything before its end: only the finished ones need work
            for seq in finished:
                self._process_finished(seq, touched)
        reports += [(request, request.report()) for request in touched.values() if request.stream or request.finished]
        return reports

    def _take_prompt_logprobs(self, scheduler: Scheduler, scored: dict[int, tuple[int, list]]) -> None:
        """Each scored chunk's entries into its request (the first chunk's positions before it from the entries its
        sequence took from the cache), and every whole prompt block now scored into the cache."""
        block_size = self.config.kvcache_block_size
        for seq in scheduler.scheduled:
            if seq.seq_id not in scored:
                continue
            request = self._requests[seq.request_id]
            first, entries = scored[seq.seq_id]
            if seq.kept_prompt_logprobs:
                request.add_prompt_logprobs(1, seq.kept_prompt_logprobs[1:first])
            request.add_prompt_logprobs(first, entries)
            known = request.scored_prompt
            num_full = len(known) // block_size
            hashes = scheduler.block_manager.block_hashes(seq, num_full)
            for b in range(first // block_size, num_full):
                block = known[b * block_size:(b + 1) * block_size]
                if None not in block[1 if b == 0 else 0:]:
                    self.prompt_logprob_cache.put(hashes[b], block)

    def _take_pooled(self, finished: list[Sequence], pooled: dict[int, list[float]],
                     touched: dict[int, Request]) -> list[Sequence]:
        """Hand each pooled sequence's vector to its request (finished now); the other finished sequences."""
        others = []
        for seq in finished:
            if seq.seq_id in pooled:
                self._requests[seq.request_id].embedding = pooled[seq.seq_id]
                self._process_finished(seq, touched)
            else:
                others.append(seq)
        return others

    def _process_tokens(self, seqs: list[Sequence], logprobs, touched: dict[int, Request],
                        reports: list[tuple[Request, object]]) -> None:
        """seqs: those that got a token this step, logprobs their rows'. A plain stream's report (its token count)
        goes to reports at once; every other request that needs one is left in touched."""
        # once per sampled sequence per step: attribute tests only for a request that needs nothing
        requests = self._requests
        for i, seq in enumerate(seqs):
            request = requests[seq.request_id]
            if seq.finish_reason is not None:  # finished in this step
                if request.per_step and not request.plain_stream and seq.finish_reason not in ("abort", NO_TOKEN):
                    found = request.on_token(seq, logprobs[i])
                    if found is not None:  # a token up to its last (max_tokens, a stop token) completed a stop string
                        self.scheduler.truncate(seq, found[1])
                        seq.finish_reason, seq.stop_reason = "stop", found[0]
                self._process_finished(seq, touched)
            elif request.plain_stream:  # no stop string can end it here; its text is grown when built
                reports.append((request, seq.num_tokens))
            elif request.per_step:
                found = request.on_token(seq, logprobs[i])
                if found is None:
                    touched[request.request_id] = request
                else:
                    self.scheduler.truncate(seq, found[1])  # a verify row's tokens after the stop string's
                    self.scheduler.finish(seq, "stop", found[0])  # frees its blocks now
                    self._process_finished(seq, touched)

    def _advance_grammars(self, seqs: list[Sequence]) -> list[Sequence]:
        """Each constrained completion's matcher takes its sampled token. Returns those their grammar ended: one that
        is complete ends on its stop token, or with ignore_eos on its grammar's end (the scheduler would run on)."""
        ended = []
        for seq in seqs:
            grammar = seq.sampling.grammar
            if grammar is None or seq.finish_reason == "abort":
                continue
            if seq.finish_reason == NO_TOKEN:  # nothing sampled: a complete grammar allowed only what min_tokens bans
                if grammar.active and grammar.matcher.is_completed():
                    seq.finish_reason = "stop"
                continue
            accepted = grammar.accept(seq.last_token)
            assert accepted, "a sampled token the grammar's mask had ruled out"
            if seq.finish_reason is None and grammar.active and grammar.matcher.is_terminated():
                self.scheduler.finish(seq, "stop", seq.last_token if seq.last_token in
                                      seq.sampling_params.stop_token_ids else None)
                ended.append(seq)
        return ended

    def _process_finished(self, seq: Sequence, touched: dict[int, Request]) -> None:
        request = self._requests[seq.request_id]
        request.on_finish(seq)
        touched[request.request_id] = request
        if request.finished:
            self._forget(request)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | list[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order. lora_request: one adapter for every
        prompt, or one (or None) per prompt.

        A prompt is a string, a list of token ids, a 1-D integer torch/numpy array, or a dict with 'prompt' or
        'prompt_token_ids'; prompts is one prompt or an iterable of them. Every prompt is checked before any is
        queued: one bad prompt raises ValueError naming it, and nothing is left half-run. Requests queued before
        with add_request keep running; their outputs wait for step().
        """
        prompts = prompt_list(prompts)
        if not (sampling_params is None or isinstance(sampling_params, (SamplingParams, list, tuple))):
            raise ValueError("sampling_params must be a SamplingParams or a list of them (one per prompt), "
                             f"got {type(sampling_params).__name__}")
        requests = self._make_requests(prompts, per_prompt(sampling_params, len(prompts), "sampling_params"),
                                       per_prompt(lora_request, len(prompts), "lora_request"))
        return self._run_to_end(requests, use_tqdm, "Generating")

    def embed(self, prompts, pooling_params: PoolingParams | list[PoolingParams] | None = None,
              use_tqdm: bool = True, lora_request: LoRARequest | list[LoRARequest | None] | None = None
              ) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding, in prompt order (prompts as generate takes them): its last hidden states
        pooled as the checkpoint says (pooling.py), in steps shared with any generation running."""
        return self._pool(prompts, pooling_params, "embed", use_tqdm, lora_request)

    def classify(self, prompts, pooling_params: PoolingParams | list[PoolingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | list[LoRARequest | None] | None = None
                 ) -> list[ClassificationRequestOutput]:
        """Each prompt's label scores from a classifier (a *ForSequenceClassification checkpoint, or one read with
        classifier_from_token), its head on the prompt's last token, in prompt order."""
        return [ClassificationRequestOutput(request_id=output.request_id, prompt=output.prompt,
                                            prompt_token_ids=output.prompt_token_ids,
                                            outputs=ClassificationOutput(output.outputs.embedding),
                                            finished=output.finished)
                for output in self._pool(prompts, pooling_params, "classify", use_tqdm, lora_request)]

    def score(self, data_1, data_2, pooling_params: PoolingParams | None = None, use_tqdm: bool = True,
              lora_request: LoRARequest | None = None) -> list[ScoringRequestOutput]:
        """Each (query, document) pair's score, as vLLM's LLM.score: data_1 one query (a text or token ids) or one
        per document of data_2. A classifier scores the pair's prompt (scoring.py's pair_prompt); an embedding
        model, the cosine similarity of the two embeddings."""
        pairs = score_pairs(data_1, data_2)
        if self.pooling.classifies:
            prompts = [pair_prompt(self.tokenizer, query, document) for query, document in pairs]
            return classifier_scores(self.classify(prompts, pooling_params=pooling_params, use_tqdm=use_tqdm,
                                                  lora_request=lora_request))
        embedded = self.embed([query for query, _ in pairs] + [document for _, document in pairs],
                              pooling_params=pooling_params, use_tqdm=use_tqdm, lora_request=lora_request)
        return cosine_scores(embedded[:len(pairs)], embedded[len(pairs):])

    def _pool(self, prompts, pooling_params, task: str, use_tqdm: bool, lora_request) -> list[EmbeddingRequestOutput]:
        prompts = prompt_list(prompts)
        if not (pooling_params is None or isinstance(pooling_params, (PoolingParams, list, tuple))):
            raise ValueError("pooling_params must be a PoolingParams or a list of them (one per prompt), "
                             f"got {type(pooling_params).__name__}")
        params = [dataclasses.replace(p or PoolingParams(), task=task)
                  for p in per_prompt(pooling_params, len(prompts), "pooling_params")]
        requests = self._make_requests(prompts, params, per_prompt(lora_request, len(prompts), "lora_request"))
        return self._run_to_end(requests, use_tqdm, "Embedding" if task == "embed" else "Classifying")

    def _make_requests(self, prompts: list, params: list, lora_requests: list) -> list[Request]:
        """Every prompt's request, checked (grammars compiled); none queued. ValueError naming the prompt."""
        requests = []
        try:
            for i, (prompt, prompt_params, lora) in enumerate(zip(prompts, params, lora_requests)):
                # grammars compile side by side on the compiler's threads, each waited for below
                requests.append(self._make_request(prompt, prompt_params, stream=False, wait_for_grammar=False,
                                                   lora_request=lora))
            for i, request in enumerate(requests):
                if request.grammar is not None:
                    self.grammar_compiler.wait(request.grammar, request.params.structured_outputs)
        except ValueError as e:
            raise InvalidRequestError(f"prompt {i}: {e}", getattr(e, "param", None)) from None
        return requests

    def _run_to_end(self, requests: list[Request], use_tqdm: bool, what: str) -> list:
        """Queue requests and step until each has its output (others' outputs wait for step()); in their order."""
        for request in requests:
            self._queue(request)
        own = {request.request_id for request in requests}
        outputs: dict[int, RequestOutput] = {}
        progress = tqdm(total=len(requests), desc=what, dynamic_ncols=True, disable=not use_tqdm)
        prefill_rate = decode_rate = 0.0
        try:
            while len(outputs) < len(requests):
                started = time.perf_counter()
                generated = self.generation_tokens_total
                reports, plan = self._step()
                elapsed = time.perf_counter() - started
                if plan is not None and plan.num_prefill_tokens:
                    prefill_rate = plan.num_prefill_tokens / elapsed
                if plan is not None and (plan.num_decode or plan.num_verify_tokens):
                    # tokens generated: a verify row's accepted drafts count
                    decode_rate = (self.generation_tokens_total - generated) / elapsed
                progress.set_postfix_str(f"prefill {prefill_rate:,.0f} tok/s, decode {decode_rate:,.0f} tok/s",
                                         refresh=False)
                for request, item in reports:
                    if request.request_id in own:  # not streamed: its report is its output
                        outputs[request.request_id] = item
                        progress.update(1)
                    else:  # someone else's request: step() hands it out
                        self._report_later(request, item)
        except BaseException:
            for request in requests:  # leave the engine clean for the next call
                self._abort(request.request_id)
            raise
        finally:
            progress.close()
        return [outputs[request.request_id] for request in requests]

    # --- lifetime -------------------------------------------------------------------------------

    def shutdown(self) -> None:
        executor = getattr(self, "executor", None)
        if executor is None:
            return
        engines = getattr(self, "scheduler", None)
        if engines is not None and engines.in_flight and not executor.closed:
            try:  # let the ranks finish the steps they run (their tokens go nowhere), so every send is received
                for _, plan, _, _ in engines.in_flight:
                    executor.collect(plan)
            except Exception:
                pass  # the executor stopped every rank
            engines.in_flight.clear()
        executor.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def __del__(self):
        self.shutdown()
