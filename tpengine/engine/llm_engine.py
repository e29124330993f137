"""Rank 0's driver: requests in, scheduled steps out to the executor, per-request outputs back."""
import dataclasses
import logging
import os
import time
from itertools import count

from tqdm.auto import tqdm

from tpengine.config import EngineConfig
from tpengine.engine.detokenizer import Detokenizer
from tpengine.engine.inputs import parse_prompt, prompt_list
from tpengine.engine.request import Request
from tpengine.engine.scheduler import Scheduler
from tpengine.engine.sequence import Sequence
from tpengine.engine.step_plan import StepPlan
from tpengine.errors import InvalidRequestError
from tpengine.hf_config import load_eos_token_ids, load_hf_config, max_model_len_of
from tpengine.outputs import RequestOutput, merge_deltas
from tpengine.sampling_params import SamplingParams

logger = logging.getLogger("tpengine")


def _load_tokenizer(model: str):
    names = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    if not any(os.path.exists(os.path.join(model, name)) for name in names):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model)


class LLMEngine:
    def __init__(self, model: str | os.PathLike, **kwargs):
        model = os.fspath(model)
        config = EngineConfig(model=model, **kwargs)
        hf_config = load_hf_config(model)
        config.validate(hf_config)
        # the model's positions and window bound every request: set once here, read by the ledger and every rank
        config.max_model_len, capped = max_model_len_of(hf_config, config.max_model_len)
        if capped:
            logger.info(capped)
        self.config = config
        self.vocab_size = hf_config.vocab_size
        self.max_model_len = config.max_model_len
        self.tokenizer = _load_tokenizer(model)
        eos_token_ids = load_eos_token_ids(model, hf_config)  # read before any worker starts: it may raise
        self.detokenizer = None if self.tokenizer is None else Detokenizer(self.tokenizer, self.vocab_size)
        if config.tensor_parallel_size > 1:
            from tpengine.runner.multiproc_executor import MultiprocExecutor
            self.executor = MultiprocExecutor(config)
        else:
            from tpengine.runner.executor import Executor
            self.executor = Executor(config)
        try:
            self.scheduler = Scheduler(
                num_kvcache_blocks=self.executor.num_kvcache_blocks, kvcache_block_size=config.kvcache_block_size,
                max_num_seqs=config.max_num_seqs, max_num_batched_tokens=self.executor.max_num_batched_tokens,
                max_model_len=self.max_model_len, eos_token_ids=eos_token_ids,
                enable_prefix_caching=config.enable_prefix_caching, scheduling_policy=config.scheduling_policy)
        except BaseException:  # workers run from here on: nothing may leave them behind
            self.executor.shutdown()
            raise
        self._request_ids = count()
        self._requests: dict[int, Request] = {}
        self._num_per_step_requests = 0     # live requests that need work every step (text, stops, logprobs)
        self._pending: dict[int, RequestOutput] = {}  # outputs the next step() reports first (generate, abort)
        self.prompt_tokens_total = 0        # prompt tokens computed (prefix-cache hits excluded)
        self.generation_tokens_total = 0    # tokens sampled

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
    def max_request_len(self) -> int:
        """Most tokens (prompt + output) one request can reach: max_model_len, or the whole cache if smaller."""
        manager = self.scheduler.block_manager
        return min(self.max_model_len, manager.num_blocks * manager.block_size)

    def check_health(self) -> None:
        """Raise if a worker is gone; between steps nothing else would notice."""
        self.executor.check_health()

    # --- requests -------------------------------------------------------------------------------

    def _make_request(self, prompt, sampling_params: SamplingParams | None, stream: bool) -> Request:
        """Validate one request and build it; nothing is queued (so a bad one leaves no trace)."""
        if sampling_params is None:
            sampling_params = SamplingParams()
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        params = sampling_params
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer, and this model folder has none: use "
                                      "stop_token_ids", "stop")
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
        try:
            prompt, token_ids = parse_prompt(prompt, self.tokenizer)
            if not token_ids:
                raise ValueError("prompt is empty: it needs at least one token")
            for t in token_ids:
                if not 0 <= t < self.vocab_size:
                    raise ValueError(f"prompt token id {t!r} is outside the vocabulary [0, {self.vocab_size})")
            self.scheduler.check_fits(len(token_ids), params.max_tokens)
        except InvalidRequestError:
            raise
        except ValueError as e:  # the prompt, or its length with max_tokens, is at fault
            raise InvalidRequestError(str(e), "prompt") from None
        block_size = self.config.kvcache_block_size
        request_id = next(self._request_ids)
        seqs = [Sequence(token_ids, params, block_size=block_size, request_id=request_id)]
        for i in range(1, params.n):  # child i samples with seed + i: reproducible, and distinct from its siblings
            child_params = params if params.seed is None else dataclasses.replace(params, seed=params.seed + i)
            seqs.append(Sequence(token_ids, child_params, block_size=block_size, index=i, parent=seqs[0],
                                 request_id=request_id))
        return Request(request_id, prompt, token_ids, params, seqs, self.detokenizer, stream)

    def _queue(self, request: Request) -> None:
        for seq in request.seqs:
            self.scheduler.add(seq)
        self._requests[request.request_id] = request
        self._num_per_step_requests += request.per_step

    def add_request(self, prompt, sampling_params: SamplingParams | None = None, *, stream: bool = True) -> int:
        """Queue one request; returns its id. Raises ValueError (and queues nothing) for bad input.
        step() reports it every step it gets a token (stream=True), or once, when it finishes."""
        request = self._make_request(prompt, sampling_params, stream)
        self._queue(request)
        return request.request_id

    def abort(self, request_id: int) -> RequestOutput | None:
        """Stop a request now; returns its final output (the next step() reports it too), or None if it is not live."""
        aborted = self._abort(request_id)
        if aborted is None:
            return None
        request, output = aborted
        self._report_later(request, output)
        return output

    def _abort(self, request_id: int) -> tuple[Request, RequestOutput] | None:
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.seqs:
            if not seq.is_finished and self.scheduler.abort(seq.seq_id) is not None:
                request.on_finish(seq)
        self._num_per_step_requests -= request.per_step
        return request, request.output()

    def has_unfinished_requests(self) -> bool:
        return not self.scheduler.is_finished() or bool(self._pending)

    # --- steps ----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step. Returns a RequestOutput for every request that got a token, finished or
        was aborted since the last step() (finished=True on its last one): everything so far, or only what
        is new for a request whose output_kind is DELTA."""
        reports, _ = self._step()
        if not self._pending:
            return [output for _, output in reports]
        for request, output in reports:
            self._report_later(request, output)
        pending, self._pending = self._pending, {}
        return list(pending.values())

    def _report_later(self, request: Request, output: RequestOutput) -> None:
        """Hold an output for the next step() (generate's for others' requests, abort's): a newer cumulative
        output holds everything an older one did; delta outputs are joined."""
        older = self._pending.get(request.request_id)
        self._pending[request.request_id] = output if older is None or not request.delta else \
            merge_deltas(older, output)

    def _step(self) -> tuple[list[tuple[Request, RequestOutput]], StepPlan | None]:
        """One step; its outputs (with their requests) and its plan (None when nothing was queued)."""
        plan = self.scheduler.schedule()
        if not plan:
            # only requests that fit the cache alone are added (check_fits), so with work queued something runs
            assert self.scheduler.is_finished(), "queued requests but nothing schedulable"
            return [], None
        sampled = self.executor.execute(plan)
        self.prompt_tokens_total += plan.num_prefill_tokens
        seqs, finished = self.scheduler.postprocess(plan, sampled.token_ids)
        self.generation_tokens_total += len(seqs)
        touched: dict[int, Request] = {}
        if self._num_per_step_requests:
            self._process_tokens(seqs, sampled.logprobs, touched)
        else:  # no request reads anything before its end: only the finished ones need work
            for seq in finished:
                self._process_finished(seq, touched)
        return [(request, request.output()) for request in touched.values() if request.stream or request.finished], plan

    def _process_tokens(self, seqs: list[Sequence], logprobs, touched: dict[int, Request]) -> None:
        """seqs: those that got a token this step, logprobs their rows'."""
        # once per sampled sequence per step: attribute tests only for a request that needs nothing
        requests = self._requests
        for i, seq in enumerate(seqs):
            request = requests[seq.request_id]
            if seq.finish_reason is not None:  # finished in this step
                if request.per_step and seq.finish_reason != "abort":
                    stop = request.on_token(seq, logprobs[i])
                    if stop is not None:  # its last token (max_tokens) completed a stop string
                        seq.finish_reason, seq.stop_reason = "stop", stop
                self._process_finished(seq, touched)
            elif request.per_step:
                stop = request.on_token(seq, logprobs[i])
                if stop is None:
                    touched[request.request_id] = request
                else:
                    self.scheduler.finish(seq, "stop", stop)  # frees its blocks now
                    self._process_finished(seq, touched)

    def _process_finished(self, seq: Sequence, touched: dict[int, Request]) -> None:
        request = self._requests[seq.request_id]
        request.on_finish(seq)
        touched[request.request_id] = request
        if request.finished:
            del self._requests[request.request_id]
            self._num_per_step_requests -= request.per_step

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        A prompt is a string, a list of token ids, a 1-D integer torch/numpy array, or a dict with 'prompt' or 'prompt_token_ids'; prompts is one prompt or an iterable of them. Every prompt is
        checked before any is queued: one bad prompt raises ValueError naming it, and nothing is left
        half-run. Requests queued before with add_request keep running; their outputs wait for step().
        """
        prompts = prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
        else:
            raise ValueError("sampling_params must be a SamplingParams or a list of them (one per prompt), "
                             f"got {type(sampling_params).__name__}")
        requests = []
        for i, (prompt, params) in enumerate(zip(prompts, sampling_params)):
            try:
                requests.append(self._make_request(prompt, params, stream=False))
            except ValueError as e:
                raise InvalidRequestError(f"prompt {i}: {e}", getattr(e, "param", None)) from None
        for request in requests:
            self._queue(request)
        own = {request.request_id for request in requests}
        outputs: dict[int, RequestOutput] = {}
        progress = tqdm(total=len(requests), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_rate = decode_rate = 0.0
        try:
            while len(outputs) < len(requests):
                started = time.perf_counter()
                reports, plan = self._step()
                elapsed = time.perf_counter() - started
                if plan is not None and plan.num_prefill_tokens:
                    prefill_rate = plan.num_prefill_tokens / elapsed
                if plan is not None and plan.num_decode:
                    decode_rate = plan.num_decode / elapsed
                progress.set_postfix_str(f"prefill {prefill_rate:,.0f} tok/s, decode {decode_rate:,.0f} tok/s",
                                         refresh=False)
                for request, output in reports:
                    if output.request_id in own:
                        outputs[output.request_id] = output
                        progress.update(1)
                    else:  # someone else's request: step() hands it out
                        self._report_later(request, output)
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
        if executor is not None:
            executor.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def __del__(self):
        self.shutdown()
