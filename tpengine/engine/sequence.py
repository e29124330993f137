"""One request's state on rank 0: its tokens, its place in the KV cache, its progress."""
from copy import copy
from enum import Enum, auto
from itertools import count

from tpengine.paging import blocks_for
from tpengine.sampling_params import SamplingParams, SamplingRecord


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    counter = count()

    # by concern: who it is; its tokens; its place in the KV cache; when it ends; speculation; scheduling
    __slots__ = (
        "seq_id", "request_id", "index", "parent",
        "token_ids", "last_token", "num_tokens", "num_prompt_tokens",
        "block_size", "block_table", "num_cached_tokens", "num_scheduled_tokens", "num_released_blocks",
        "num_prompt_cached_tokens", "block_hashes", "long_rope", "on_workers",
        "sampling_params", "sampling", "max_tokens", "ignore_eos", "eos_and_stop_token_ids", "max_num_tokens",
        "min_tokens", "status", "finish_reason", "stop_reason",
        "speculates", "draft_token_ids", "num_draft_cached_tokens",
        "arrival_step", "virtual_engine", "lora", "lora_slot", "pooling", "prompt_only", "reuse_limit",
        "kept_prompt_logprobs", "multimodal",
    )

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams, block_size: int, *,
                 index: int = 0, parent: "Sequence | None" = None, request_id: int = -1, lora=None, multimodal=None):
        # --- who it is
        self.seq_id = next(Sequence.counter)
        # its request, by id: a reference back would make a cycle only the cycle collector frees
        self.request_id = request_id
        self.index = index                  # which of its request's n completions
        # Completions 1..n-1 of a request fork the parent's prompt blocks (scheduler); cleared once they have their own
        self.parent = parent
        # its LoRA adapter (a LoRARequest; None: the base model) and, while it has blocks, its slot; its prompt's
        # images and M-RoPE positions (a MultiModalPrompt, tpengine/multimodal/prompt.py; None: text alone)
        self.lora, self.lora_slot, self.multimodal = lora, -1, multimodal

        # --- its tokens
        self.token_ids = copy(token_ids)  # a copy: the caller's list is never mutated
        self.last_token = token_ids[-1]
        self.num_tokens = len(self.token_ids)
        self.num_prompt_tokens = len(token_ids)

        # --- its place in the KV cache
        self.block_size = block_size  # the engine's, per sequence (the seed's class-wide 256 was a global)
        self.block_table: list[int] = []  # logical block i -> physical block id; -1: released (out of the window)
        self.num_cached_tokens = 0        # tokens whose K/V is already in the cache
        self.num_scheduled_tokens = 0     # tokens computed in the current step
        self.num_released_blocks = 0      # its first blocks given back because no later token can see them
        self.num_prompt_cached_tokens = -1  # prefix-cache hit of the first allocation, for the user
        self.block_hashes: list[int] = []  # chain hashes of its full blocks, memoized by the BlockManager
        # the most prompt tokens whose cached K/V it may reuse (None: any), and their kept prompt logprobs
        self.reuse_limit, self.kept_prompt_logprobs = None, []
        self.long_rope = False  # its K/V computed with LongRoPE's long factors (its chain has its own root)
        self.on_workers = False             # every rank holds its block table (sent when it was scheduled)

        # --- how it is sampled and when it ends
        self.sampling_params = sampling_params
        self.sampling: SamplingRecord | None = None  # how the sampler treats it; made by Scheduler.add
        self.max_tokens = sampling_params.max_tokens
        self.ignore_eos = sampling_params.ignore_eos
        # Finish conditions, one test each per sampled token (scheduler.finish_of): "stop" on any of these ids,
        # "length" at max_num_tokens. Scheduler.add folds in EOS (unless ignore_eos) and max_model_len.
        self.eos_and_stop_token_ids = frozenset(sampling_params.stop_token_ids)
        self.max_num_tokens = self.num_prompt_tokens + sampling_params.max_tokens
        self.min_tokens = sampling_params.min_tokens
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # pooling: an embedding's (dimensions, normalize); prompt_only: it ends with its prompt, no token sampled
        self.pooling, self.prompt_only = None, sampling_params.max_tokens == 0

        # --- speculative decoding (engine/speculation.py)
        self.speculates = False             # its tokens may be proposed ahead and verified (set by Scheduler.add)
        # the proposed tokens the step in flight verifies after its last token: they have slots, no place in
        # token_ids until accepted
        self.draft_token_ids: list[int] = []
        # a draft model's K/V on the ranks: written for this many first tokens (it runs only in steps that draft,
        # and a verify row brings it up to date first)
        self.num_draft_cached_tokens = 0

        # --- scheduling
        self.arrival_step = 0               # the scheduler's step count when it was queued, for aging
        self.virtual_engine = 0             # which of the engine's schedulers holds it (engine/virtual_engines.py)

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_blocks(self) -> int:
        return blocks_for(self.num_tokens, self.block_size)

    def block(self, i: int) -> list[int]:
        """Block i's keys in the prefix cache: its tokens (an image's placeholders as the image's key)."""
        assert 0 <= i < self.num_blocks
        return self.cache_keys(i * self.block_size, (i + 1) * self.block_size)

    def cache_keys(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) as the prefix cache keys them: the tokens, an image's placeholders as its image's
        key (the same image reuses cached K/V, another never does)."""
        if self.multimodal is None:
            return self.token_ids[start:end]
        return self.multimodal.cache_keys(self.token_ids, start, min(end, self.num_tokens))

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.last_token = token_id
        self.num_tokens += 1
