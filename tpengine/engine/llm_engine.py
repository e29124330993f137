"""Rank 0's driver: requests in, scheduled steps out to the executor, finished outputs back."""
import logging
import os
import time
from collections.abc import Sequence as SequenceLike

from tqdm.auto import tqdm

from tpengine.config import EngineConfig, load_hf_config
from tpengine.engine.scheduler import Scheduler
from tpengine.engine.sequence import Sequence
from tpengine.outputs import RequestOutput
from tpengine.sampling_params import SamplingParams

logger = logging.getLogger("tpengine")


def _load_tokenizer(model: str):
    names = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    if not any(os.path.exists(os.path.join(model, name)) for name in names):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model)


def _eos_token_ids(model: str, hf_config) -> frozenset[int]:
    from transformers import GenerationConfig
    try:
        eos = GenerationConfig.from_pretrained(model).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


class LLMEngine:
    def __init__(self, model: str | os.PathLike, **kwargs):
        model = os.fspath(model)
        config = EngineConfig(model=model, **kwargs)
        hf_config = load_hf_config(model)
        config.validate(hf_config)
        self.config = config
        self.vocab_size = hf_config.vocab_size
        self.max_model_len = min(config.max_model_len, hf_config.max_position_embeddings)
        self.tokenizer = _load_tokenizer(model)
        eos_token_ids = _eos_token_ids(model, hf_config)  # read before any worker starts: it may raise
        if config.tensor_parallel_size > 1:
            from tpengine.runner.multiproc_executor import MultiprocExecutor
            self.executor = MultiprocExecutor(config)
        else:
            from tpengine.runner.executor import Executor
            self.executor = Executor(config)
        self.scheduler = Scheduler(
            num_kvcache_blocks=self.executor.num_kvcache_blocks, kvcache_block_size=config.kvcache_block_size,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len, eos_token_ids=eos_token_ids,
            enable_prefix_caching=config.enable_prefix_caching)
        self._prompts: dict[int, str | list[int]] = {}

    # --- requests -------------------------------------------------------------------------------

    def _prompt_token_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model folder has no tokenizer: pass prompts as lists of token ids")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
        if not token_ids:
            raise ValueError("prompt is empty: it needs at least one token")
        for t in token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt token id {t!r} is outside the vocabulary [0, {self.vocab_size})")
        return token_ids

    def _make_sequence(self, prompt: str | list[int], sampling_params: SamplingParams) -> Sequence:
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        token_ids = self._prompt_token_ids(prompt)
        self.scheduler.check_fits(len(token_ids), sampling_params.max_tokens)
        return Sequence(token_ids, sampling_params, block_size=self.config.kvcache_block_size)

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams = SamplingParams()) -> int:
        """Queue one request; returns its id. Raises ValueError (and queues nothing) for bad input."""
        seq = self._make_sequence(prompt, sampling_params)
        self.scheduler.add(seq)
        self._prompts[seq.seq_id] = prompt
        return seq.seq_id

    def abort(self, request_id: int) -> RequestOutput | None:
        seq = self.scheduler.abort(request_id)
        return None if seq is None else self._output(seq)

    def has_unfinished_requests(self) -> bool:
        return not self.scheduler.is_finished()

    # --- steps ----------------------------------------------------------------------------------

    def step(self) -> tuple[list[RequestOutput], int]:
        """Run one scheduled step. Returns the requests that finished and the number of tokens
        computed: positive for a prefill step, negative (minus the batch size) for a decode step."""
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            # add() admits only requests that fit the cache alone, so with work queued something runs
            assert self.scheduler.is_finished(), "queued requests but nothing schedulable"
            return [], 0
        num_tokens = sum(seq.num_scheduled_tokens for seq in seqs) if is_prefill else -len(seqs)
        token_ids = self.executor.execute(seqs, is_prefill)
        finished = self.scheduler.postprocess(seqs, token_ids)
        return [self._output(seq) for seq in finished], num_tokens

    def _output(self, seq: Sequence) -> RequestOutput:
        completion = seq.completion_token_ids
        text = None if self.tokenizer is None else self.tokenizer.decode(completion, skip_special_tokens=True)
        return RequestOutput(
            request_id=seq.seq_id, prompt=self._prompts.pop(seq.seq_id, None),
            prompt_token_ids=seq.prompt_token_ids, token_ids=completion, text=text,
            finish_reason=seq.finish_reason, num_cached_tokens=max(seq.num_prompt_cached_tokens, 0))

    def generate(self, prompts: SequenceLike, sampling_params: SamplingParams | SequenceLike = SamplingParams(),
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        Every prompt is checked before any is queued: one bad prompt raises ValueError naming it,
        and nothing is left half-run.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
        seqs = []
        for i, (prompt, params) in enumerate(zip(prompts, sampling_params)):
            try:
                seqs.append(self._make_sequence(prompt, params))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        for prompt, seq in zip(prompts, seqs):
            self.scheduler.add(seq)
            self._prompts[seq.seq_id] = prompt
        outputs: dict[int, RequestOutput] = {}
        progress = tqdm(total=len(seqs), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_rate = decode_rate = 0.0
        try:
            while self.has_unfinished_requests():
                started = time.perf_counter()
                finished, num_tokens = self.step()
                elapsed = time.perf_counter() - started
                if num_tokens > 0:
                    prefill_rate = num_tokens / elapsed
                elif num_tokens < 0:
                    decode_rate = -num_tokens / elapsed
                progress.set_postfix_str(f"prefill {prefill_rate:,.0f} tok/s, decode {decode_rate:,.0f} tok/s",
                                         refresh=False)
                for output in finished:
                    outputs[output.request_id] = output
                    progress.update(1)
        except BaseException:
            for seq in seqs:  # leave the engine clean for the next call
                self.scheduler.abort(seq.seq_id)
                self._prompts.pop(seq.seq_id, None)
            raise
        finally:
            progress.close()
        return [outputs[seq.seq_id] for seq in seqs]

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
