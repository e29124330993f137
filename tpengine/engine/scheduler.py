"""Decides each step's batch: prefill first (the head may be chunked), else decode; preempts by recompute."""
from collections import deque

from tpengine.engine.block_manager import BlockManager
from tpengine.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, *, num_kvcache_blocks: int, kvcache_block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, eos_token_ids: frozenset[int],
                 enable_prefix_caching: bool = True):
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.block_manager = BlockManager(num_kvcache_blocks, kvcache_block_size, enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise ValueError for a request that could never run, before it is queued."""
        if num_prompt_tokens > self.max_model_len:
            raise ValueError(f"prompt has {num_prompt_tokens} tokens, more than max_model_len={self.max_model_len}")
        # Generation stops at max_model_len, so that bounds the blocks one sequence can need.
        max_len = min(num_prompt_tokens + max_tokens, self.max_model_len)
        block_size = self.block_manager.block_size
        blocks_needed = (max_len + block_size - 1) // block_size
        if blocks_needed > self.block_manager.num_blocks:
            raise ValueError(
                f"request needs up to {max_len} tokens = {blocks_needed} KV-cache blocks of {block_size} "
                f"tokens, but the whole cache has only {self.block_manager.num_blocks} blocks; "
                f"shorten the prompt or max_tokens, or give the cache more blocks")

    def add(self, seq: Sequence) -> None:
        assert seq.block_size == self.block_manager.block_size, "sequence and ledger disagree on block size"
        self.check_fits(seq.num_prompt_tokens, seq.max_tokens)
        # Fold the engine's stop conditions into the sequence's own, so postprocess does one set
        # test and one comparison per sampled token: both "stop" reasons, both "length" reasons.
        if not seq.ignore_eos:
            seq.eos_and_stop_token_ids = seq.eos_and_stop_token_ids | self.eos_token_ids
        seq.max_num_tokens = min(seq.max_num_tokens, self.max_model_len)
        self.waiting.append(seq)

    def schedule(self) -> tuple[list[Sequence], bool]:
        scheduled = self._schedule_prefill()
        if scheduled:
            return scheduled, True
        return self._schedule_decode(), False

    def _schedule_prefill(self) -> list[Sequence]:
        block_manager = self.block_manager
        scheduled: list[Sequence] = []
        token_budget = self.max_num_batched_tokens
        # max_num_seqs bounds the running set, not only each batch: admitted sequences hold blocks
        num_running = len(self.running)
        while self.waiting and num_running + len(scheduled) < self.max_num_seqs and token_budget > 0:
            seq = self.waiting[0]
            if not seq.block_table and seq.parent is not None:
                parent = seq.parent
                if parent.status == SequenceStatus.RUNNING and parent.num_cached_tokens >= parent.num_prompt_tokens:
                    if not block_manager.free_block_ids:
                        break
                    block_manager.fork(seq, parent)
                    seq.num_prompt_cached_tokens = parent.num_prompt_cached_tokens
                    seq.parent = None
                elif not parent.is_finished:
                    break  # its parent's prompt is being computed: wait for it, then fork it
                else:
                    seq.parent = None  # nothing left to fork: prefill as any request (prefix hits apply)
            if not seq.block_table:
                num_cached_blocks = block_manager.can_allocate(seq)
                if num_cached_blocks == -1:
                    break
                num_new_tokens = seq.num_tokens - num_cached_blocks * block_manager.block_size
                if scheduled and num_new_tokens > token_budget:
                    break  # only the first sequence of a batch may be chunked
                block_manager.allocate(seq, num_cached_blocks)
                if seq.num_prompt_cached_tokens < 0:
                    seq.num_prompt_cached_tokens = seq.num_cached_tokens
            # A partly prefilled sequence stays at the head of waiting until its last chunk, so it
            # is always first in its batch: the check above is the only one a later sequence needs.
            num_new_tokens = seq.num_tokens - seq.num_cached_tokens
            seq.num_scheduled_tokens = min(num_new_tokens, token_budget)
            token_budget -= seq.num_scheduled_tokens
            scheduled.append(seq)
            if seq.num_scheduled_tokens < num_new_tokens:
                break  # chunked: the rest comes in later steps
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
        return scheduled

    def _schedule_decode(self) -> list[Sequence]:
        # This loop and postprocess run once per running sequence per step: locals are bound
        # up front and the common case (no new block needed) makes no function call.
        block_size = self.block_manager.block_size
        running = self.running
        scheduled: list[Sequence] = []
        for _ in range(min(len(running), self.max_num_seqs, self.max_num_batched_tokens)):
            if not running:
                break  # preemptions emptied the queue
            seq = running.popleft()
            # BlockManager.can_append's test, checked here first: only a sequence whose next
            # token opens a new block can need a free one.
            if seq.num_tokens % block_size == 1 and not self._append_block(seq):
                break  # seq preempted itself: nothing else was running
            seq.num_scheduled_tokens = 1
            seq.is_prefill = False
            scheduled.append(seq)
        running.extendleft(reversed(scheduled))
        return scheduled

    def _append_block(self, seq: Sequence) -> bool:
        """Give seq the block its next token opens, preempting from the tail of running while the
        cache is full. False if seq itself had to be preempted."""
        block_manager = self.block_manager
        while not block_manager.can_append(seq):
            if not self.running:
                self._preempt(seq)
                return False
            self._preempt(self.running.pop())  # the latest to run loses the least work
        block_manager.may_append(seq)
        return True

    def _preempt(self, seq: Sequence) -> None:
        # Recompute: drop its blocks; its re-prefill can still hit them while they stay unwritten.
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        seq.is_prefill = True
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def postprocess(self, seqs: list[Sequence], token_ids: list[int]) -> list[Sequence]:
        """Account for the step just run and append sampled tokens; returns the sequences that finished."""
        hash_blocks = self.block_manager.hash_blocks
        block_size = self.block_manager.block_size
        finished = []
        for seq, token_id in zip(seqs, token_ids):
            num_cached_tokens = seq.num_cached_tokens + seq.num_scheduled_tokens
            # Only a step that filled a block has anything to register (in decode, one step in
            # block_size): skip the call otherwise. hash_blocks reads the counters before the update.
            if num_cached_tokens // block_size != seq.num_cached_tokens // block_size:
                hash_blocks(seq)
            seq.num_cached_tokens = num_cached_tokens
            seq.num_scheduled_tokens = 0
            if num_cached_tokens < seq.num_tokens:
                continue  # a chunk of prefill that did not reach the last token: nothing sampled
            if token_id < 0:  # the sampler found no finite distribution for this row (NaN logits)
                self.finish(seq, "abort")
                finished.append(seq)
                continue
            seq.append_token(token_id)
            # add() folded EOS and max_model_len into these two fields.
            if token_id in seq.eos_and_stop_token_ids and seq.num_tokens - seq.num_prompt_tokens >= seq.min_tokens:
                # a stop token the user listed is the reason; EOS has none
                self.finish(seq, "stop", token_id if token_id in seq.sampling_params.stop_token_ids else None)
            elif seq.num_tokens >= seq.max_num_tokens:
                self.finish(seq, "length")
            else:
                continue
            finished.append(seq)
        return finished

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """End a running sequence now and free its blocks (also for a stop string the engine matched)."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.block_manager.deallocate(seq)
        self.running.remove(seq)

    def abort(self, seq_id: int) -> Sequence | None:
        """Drop a request wherever it is; returns it, or None if it is not queued."""
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.seq_id == seq_id:
                    queue.remove(seq)
                    if seq.block_table:
                        self.block_manager.deallocate(seq)
                    seq.status = SequenceStatus.FINISHED
                    seq.finish_reason = "abort"
                    return seq
        return None
