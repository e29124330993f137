"""Decides each step's batch as a StepPlan (a value: the message every rank runs and the sampled rows'
records); preempts by recompute.

Two policies: "mixed" (vLLM's) gives every running sequence its next token first and fills the rest of
the token budget with prompt chunks, so decodes never stall behind a long prompt; "prefill_first"
(nano-vllm's) runs a prefill step whenever a prompt waits and decodes only when none does.

Speculative decoding (a proposer given): engine/speculation.py keeps its share of the ledger; the scheduler gives
a verify row's drafts their slots, and postprocess appends the kept drafts and the first differing token, and
frees the blocks that hold only rejected drafts. The block-table changes each step carries: engine/table_deltas.py.

LongRoPE (long_rope_threshold: the pre-training window): transformers rotates a whole sequence with one set of
factors, the long one once it has more tokens than the window (models/phi3.py). A sequence takes its set when
admitted (_admit_rope_set); a short one never computes a token past the window: its drafts stop short of it, and
the decode row that would pass it preempts it instead, so its re-prefill recomputes it all with the long set, as
transformers' generate does."""
from collections import deque
from itertools import islice

from tpengine.config import SCHEDULING_POLICIES
from tpengine.distributed.messages import BlockCopy, BlockTable, PoolChunk, PrefillChunk, StepMessage, int_column
from tpengine.engine.block_manager import BlockManager, PrefixMatch, chain_root
from tpengine.engine.draft_policy import DraftPolicy
from tpengine.engine.lora_slots import LoRASlots
from tpengine.engine.prefix_index import HeadIndex
from tpengine.engine.prompt_logprob_cache import PromptLogprobCache
from tpengine.engine.proposer import Proposer, speculates
from tpengine.engine.sequence import Sequence, SequenceStatus
from tpengine.engine.speculation import Speculation
from tpengine.engine.step_plan import StepPlan
from tpengine.engine.table_deltas import TableDeltas
from tpengine.outputs import NO_TOKEN
from tpengine.paging import blocks_for
from tpengine.sampling_params import SamplingRecord

# Cache-aware admission orders only this many requests from the head of the waiting queue, so its
# cost per step stays bounded; the rest keep arrival order.
ADMISSION_WINDOW = 128
# A request that has waited this many steps is admitted in arrival order, ahead of every younger
# one, and is never held back: no request waits unboundedly behind cache hits.
MAX_WAIT_STEPS = 16
# Holding a request back one step pays off when the batch computes at least this many more of its
# tokens than the cache holds (or a whole block, for smaller blocks).
MIN_SHARED_TOKENS_TO_WAIT = 32


def finish_of(seq: Sequence, token_id: int, num_tokens: int) -> tuple[str, int | str | None] | None:
    """The one finish check, for each sampled token, as it would make seq num_tokens long: (reason, stop_reason)
    or None. Scheduler.add folded EOS and max_model_len into the fields read here."""
    if token_id < 0:  # the sampler found no finite distribution for its row (NaN logits, or no token allowed)
        return NO_TOKEN, None
    if token_id in seq.eos_and_stop_token_ids and num_tokens - seq.num_prompt_tokens >= seq.min_tokens:
        # a stop token the user listed is the reason; EOS has none
        return "stop", token_id if token_id in seq.sampling_params.stop_token_ids else None
    if num_tokens >= seq.max_num_tokens:
        return "length", None
    return None


class Scheduler:
    def __init__(self, *, num_kvcache_blocks: int, kvcache_block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, eos_token_ids: frozenset[int],
                 enable_prefix_caching: bool = True, scheduling_policy: str = "mixed",
                 proposer: Proposer | None = None, num_speculative_tokens: int = 0,
                 draft_policy: DraftPolicy | None = None, sliding_window: int | None = None,
                 long_rope_threshold: int | None = None, first_block_id: int = 0, virtual_engine: int = 0,
                 lora_slots: LoRASlots | None = None, prompt_logprobs: PromptLogprobCache | None = None):
        if scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {scheduling_policy!r}")
        self.scheduling_policy = scheduling_policy
        self.virtual_engine = virtual_engine  # which of the engine's schedulers this is: its steps' pipeline tag
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        # LongRoPE's window: a sequence of more tokens is rotated with the long factors (None: no such model)
        self.long_rope_threshold = long_rope_threshold
        # sliding_window: every layer's, where all of them slide; the blocks behind it go back as sequences grow
        self.block_manager = BlockManager(num_kvcache_blocks, kvcache_block_size, enable_prefix_caching,
                                          sliding_window, first_block_id)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.num_steps = 0
        # the step in flight (scheduled, not yet postprocessed): its decode and prefill sequences, its message
        self._in_flight: tuple[list[Sequence], list[Sequence], StepMessage] | None = None
        self.deltas = TableDeltas()  # the block-table changes the next message carries
        # the last step's decode rows (a list schedule() made), with their sequence-id column and sampling records
        # (and their LoRA slots' column)
        # the last decode batch and its columns: (sequences, seq ids, sampling records, LoRA slots, position offsets)
        self._last_decode: tuple[list[Sequence], bytes, list[SamplingRecord], bytes, bytes] = ([], b"", [], b"", b"")
        assert (proposer is None) == (num_speculative_tokens == 0)
        self.proposer = proposer
        self.speculation = None if proposer is None else Speculation(proposer, num_speculative_tokens, draft_policy)
        self.num_speculative_tokens = num_speculative_tokens
        self.num_output_tokens = 0  # tokens appended to sequences by postprocess (verify rows append several)
        # LoRA adapters (engine/lora_slots.py, shared by the engine's schedulers); None: the engine serves none
        self.lora_slots = lora_slots
        # prompt logprobs kept by block hash beside the prefix cache (engine/prompt_logprob_cache.py)
        self.prompt_logprobs = prompt_logprobs or PromptLogprobCache(0)

    # --- read-only counters, for metrics ----------------------------------------------------------

    def _speculation_counter(name: str):
        return property(lambda self: getattr(self.speculation, name) if self.speculation is not None else 0,
                        doc=f"speculative decoding's {name} (engine/speculation.py); 0 without it")

    num_drafts = _speculation_counter("num_drafts")
    num_draft_tokens = _speculation_counter("num_draft_tokens")
    num_accepted_tokens = _speculation_counter("num_accepted_tokens")
    del _speculation_counter

    @property
    def num_accepted_tokens_per_pos(self) -> list[int]:
        return [] if self.speculation is None else self.speculation.num_accepted_tokens_per_pos

    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache so far (re-prefills after preemption included)."""
        return self.block_manager.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        """Of those, the tokens whose K/V came from the cache instead of being computed."""
        return self.block_manager.prefix_cache_hits

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV-cache blocks held by requests, 0.0 to 1.0."""
        return self.block_manager.usage

    @property
    def block_copies(self) -> list[tuple[int, int, int]]:
        """(src, dst, num_tokens) block-head copies the scheduled step needs before its forward."""
        return self.block_manager.block_copies

    @property
    def scheduled(self) -> list[Sequence]:
        """The sequences of the step in flight (scheduled, not yet postprocessed), in row order: decode rows,
        then prompt chunks, then verify rows. The ledger's side of the plan; the ranks see only its message."""
        if self._in_flight is None:
            return []
        decode, verify, prefill, _ = self._in_flight
        return decode + prefill + verify

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise ValueError for a request that could never run, before it is queued."""
        if num_prompt_tokens > self.max_model_len:
            raise ValueError(f"prompt has {num_prompt_tokens} tokens, more than max_model_len={self.max_model_len}")
        # Generation stops at max_model_len, so that bounds the blocks one sequence can need.
        max_len = min(num_prompt_tokens + max_tokens, self.max_model_len)
        block_size = self.block_manager.block_size
        blocks_needed = blocks_for(max_len, block_size)
        window = self.block_manager.sliding_window
        if window is not None:
            # every layer slides: a step holds the window behind its first token and the tokens it computes
            # (a prompt chunk, or a token and its drafts), one partly filled block at each end, and a copy source
            step_tokens = max(self.max_num_batched_tokens, self.num_speculative_tokens + 1)
            blocks_needed = min(blocks_needed, (window + step_tokens + 2 * block_size - 2) // block_size + 1)
        if blocks_needed > self.block_manager.num_blocks:
            needs = (f"up to {max_len} tokens = {blocks_needed} KV-cache blocks" if window is None else
                     f"{blocks_needed} KV-cache blocks at once (the sliding window of {window} tokens and a step's "
                     f"{step_tokens})")
            raise ValueError(
                f"request needs {needs} of {block_size} tokens, but the whole cache has only "
                f"{self.block_manager.num_blocks} blocks; shorten the prompt or max_tokens, or give the cache "
                f"more blocks")

    def add(self, seq: Sequence) -> None:
        """Queue a sequence whose request passed check_fits (the engine checks once per request)."""
        assert seq.block_size == self.block_manager.block_size, "sequence and ledger disagree on block size"
        # Fold the engine's stop conditions into the sequence's own, so postprocess does one set
        # test and one comparison per sampled token: both "stop" reasons, both "length" reasons.
        if not seq.ignore_eos:
            seq.eos_and_stop_token_ids = seq.eos_and_stop_token_ids | self.eos_token_ids
        seq.max_num_tokens = min(seq.max_num_tokens, self.max_model_len)
        seq.sampling = SamplingRecord(seq.sampling_params, seq.eos_and_stop_token_ids, seq.token_ids,
                                      seq.num_prompt_tokens)
        seq.arrival_step = self.num_steps
        seq.speculates = self.proposer is not None and seq.pooling is None and speculates(seq.sampling_params)
        self.waiting.append(seq)

    def schedule(self) -> StepPlan:
        """The next step's plan; empty only when nothing is queued."""
        self.num_steps += 1
        if self._in_flight is not None:
            self._forget_step_in_flight()
        if self.scheduling_policy == "prefill_first":
            prefill = self._schedule_prefill(self.max_num_batched_tokens) if self.waiting else []
            decode = [] if prefill else self._schedule_decode()
            if not decode and self.waiting and not prefill:  # its decodes preempted every running sequence
                prefill = self._schedule_prefill(self.max_num_batched_tokens)
        else:
            # decodes first, so a long prompt never stalls them; prompt chunks take what is left
            decode = self._schedule_decode() if self.running else []
            token_budget = self.max_num_batched_tokens - len(decode)
            if self.proposer is not None:
                token_budget -= sum(len(seq.draft_token_ids) for seq in decode)
            prefill = self._schedule_prefill(token_budget) if self.waiting and token_budget > 0 else []
        if not (decode or prefill):  # nothing queued: the pending table changes wait for a step that runs
            return StepPlan(StepMessage(), [], 0)
        verify = []
        if self.proposer is not None:
            verify = [seq for seq in decode if seq.draft_token_ids]
            if verify:
                decode = [seq for seq in decode if not seq.draft_token_ids]
        plan = self._plan(decode, verify, prefill)
        self._in_flight = decode, verify, prefill, plan.message
        return plan

    def _plan(self, decode: list[Sequence], verify: list[Sequence], prefill: list[Sequence]) -> StepPlan:
        """The step as a value: every rank's message, and the sampled rows' records (in row order)."""
        last_decode, decode_seq_ids, decode_sampling = self._last_decode[:3]
        if decode != last_decode:  # by identity: a batch that runs again unchanged (most steps) reuses all three
            decode_seq_ids = int_column([seq.seq_id for seq in decode])
            decode_sampling = [seq.sampling for seq in decode]
            decode_lora_slots = b"" if self.lora_slots is None else int_column([seq.lora_slot for seq in decode])
            decode_offsets = decode_position_offsets(decode)
            self._last_decode = decode, decode_seq_ids, decode_sampling, decode_lora_slots, decode_offsets
        else:
            decode_lora_slots, decode_offsets = self._last_decode[3:]
        chunks, new_tables, sampling = [], [], list(decode_sampling)
        num_prefill_tokens = 0
        add_whole_table = self.deltas.add_whole_table
        for seq in prefill:
            start, end = seq.num_cached_tokens, seq.num_cached_tokens + seq.num_scheduled_tokens
            sampled = end == seq.num_tokens
            pooling = None if seq.pooling is None else PoolChunk(*seq.pooling, sampled)
            scored = seq.sampling_params.prompt_logprobs is not None and start < seq.num_prompt_tokens
            sampled = sampled and not seq.prompt_only  # an embedding's or a scored prompt's: no token sampled
            multimodal = seq.multimodal
            chunks.append(PrefillChunk(seq.seq_id, seq.token_ids[start:end], start, sampled, 0, seq.long_rope,
                                       lora_slot=seq.lora_slot, pooling=pooling, prompt_logprobs=scored,
                                       next_token=seq.token_ids[end] if scored and end < seq.num_prompt_tokens
                                       else -1,
                                       positions=b"" if multimodal is None else multimodal.chunk_positions(start, end),
                                       images=[] if multimodal is None else multimodal.chunk_images(start, end)))
            num_prefill_tokens += end - start
            if sampled:
                sampling.append(seq.sampling)
            add_whole_table(seq, new_tables)
        num_verify_tokens = 0
        if self.speculation is not None:
            num_verify_tokens = self.speculation.add_verify_rows(decode, verify, prefill, chunks, sampling,
                                                                 self.block_manager.block_size)
        # a decode row's table is on the workers (sent when the sequence was prefilled), unless they dropped
        # them all (an interrupted step): then each takes its whole table when it next runs
        if self.deltas.resend_decode_tables:
            self.deltas.resend_tables_of(decode + verify, self.running, new_tables)
        message = StepMessage(
            decode_seq_ids, int_column([seq.last_token for seq in decode]),
            int_column([seq.num_tokens for seq in decode]), chunks, new_tables=new_tables,
            block_copies=[BlockCopy(*copy) for copy in self.block_manager.block_copies],
            draft_prompts=self.speculation is None or self.speculation.drafting,
            virtual_engine=self.virtual_engine,
            lora_loads=[] if self.lora_slots is None else self.lora_slots.take_loads(),
            decode_lora_slots=decode_lora_slots, decode_position_offsets=decode_offsets, **self.deltas.take())
        return StepPlan(message, sampling, num_prefill_tokens, num_verify_tokens)

    def _forget_step_in_flight(self) -> None:
        """The last step never reached postprocess (interrupted, say by Ctrl-C in generate): undo it. Its
        prompts give their blocks back and wait again (prefix hits recover what the cache holds; a copy it
        planned may never have run), its decode and verify rows give back the blocks they opened (drafts'
        included); and since no one knows which of its block-table changes the ranks applied, every rank
        drops every table and takes each sequence's whole table when it next runs."""
        decode, verify, prefill, message = self._in_flight
        self._in_flight = None
        if self.speculation is not None:
            self.speculation.draft_caught_up = []
        for seq in decode + verify:
            assert seq.num_cached_tokens == seq.num_tokens - 1, "a running sequence computes its last token"
            seq.num_scheduled_tokens = 0
            seq.draft_token_ids = []
            self.block_manager.shrink(seq, blocks_for(seq.num_cached_tokens, self.block_manager.block_size))
        for seq in reversed(prefill):
            seq.num_scheduled_tokens = 0
            if seq.status == SequenceStatus.RUNNING:
                self.running.remove(seq)
                seq.status = SequenceStatus.WAITING
            else:
                self.waiting.remove(seq)  # a chunk short of its prompt's end
            self.block_manager.deallocate(seq)  # while its copies are listed: their heads count as unwritten
            self._give_back_lora_slot(seq)
            self.waiting.appendleft(seq)
        if message.lora_loads:
            self.lora_slots.forget_loads(message.lora_loads)
        if self.block_manager.block_copies:
            self.block_manager.release_copy_sources()
        self.deltas.start_over((*self.running, *self.waiting))

    def _schedule_prefill(self, token_budget: int) -> list[Sequence]:
        block_manager = self.block_manager
        scheduled: list[Sequence] = []
        # max_num_seqs bounds the running set, not only each batch: admitted sequences hold blocks
        num_running = len(self.running)
        room, waiting = self.max_num_seqs - num_running, self.waiting
        # every new admission takes a free block; only a partly prefilled sequence needs none
        if room <= 0 or not (block_manager.num_free_blocks or waiting[0].block_table):
            return scheduled
        # the requests this step may admit (read in place: a step that admits none changes nothing)
        head = list(islice(waiting, ADMISSION_WINDOW + room))
        if self.long_rope_threshold is not None:
            for seq in head:
                if not seq.block_table:
                    self._admit_rope_set(seq)
        # what this batch computes, block by block: a request sharing it waits a step to reuse it
        computing = HeadIndex() if block_manager.enable_prefix_caching else None
        oldest_fresh_step = self.num_steps - MAX_WAIT_STEPS
        chunked, encoder_budget = None, self.max_num_batched_tokens  # the image tokens this step may start encoding
        for seq in self._admission_order(head):
            if num_running + len(scheduled) >= self.max_num_seqs or token_budget <= 0:
                break
            if not seq.block_table and seq.parent is not None:
                forked = self._fork_from_parent(seq)
                if forked is None:
                    break
                if not forked and seq.parent is not None:
                    continue  # its parent's prompt is being computed: wait for it, then fork it
            if not seq.block_table:
                if not self._ready_to_admit(seq):
                    continue  # every adapter slot serves running requests: it waits, others may go
                match = block_manager.can_allocate(seq, token_budget)
                if match is None:
                    break
                if (computing is not None and seq.arrival_step > oldest_fresh_step
                        and self._waits_for_batch(seq, match, computing)):
                    continue
                num_new_tokens = seq.num_tokens - match.num_cached_tokens
                if scheduled and num_new_tokens > token_budget:
                    break  # only the first sequence of a batch may be chunked
                self._allocate(seq, match)
            elif block_manager.sliding_window is not None and not self._grow_for_chunk(seq, token_budget):
                break
            num_new_tokens = seq.num_tokens - seq.num_cached_tokens
            # where every layer slides, the table may cover only part of the rest (its blocks grow by chunk)
            seq.num_scheduled_tokens = min(num_new_tokens, token_budget,
                                           len(seq.block_table) * block_manager.block_size - seq.num_cached_tokens)
            encoder_budget = cut_for_encoder(seq, encoder_budget)
            token_budget -= seq.num_scheduled_tokens
            scheduled.append(seq)
            if computing is not None:
                self._note_computing(seq, computing)
            if seq.num_scheduled_tokens < num_new_tokens:
                chunked = seq  # the rest comes in later steps
                break
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        if scheduled:
            self._requeue_head(head, chunked)
        return scheduled

    def _ready_to_admit(self, seq: Sequence) -> bool:
        """Whether seq may take blocks now: its adapter has a slot to go to. A scored prompt learns how much of the
        prefix cache it may reuse: the blocks whose prompt logprobs are kept (engine/prompt_logprob_cache.py)."""
        if seq.lora is not None and not self.lora_slots.can_take(seq.lora):
            return False
        if seq.sampling_params.prompt_logprobs is not None:
            num_full = seq.num_blocks - 1
            hashes = self.block_manager.block_hashes(seq, num_full)[:num_full]
            run = self.prompt_logprobs.kept_run(hashes)
            seq.reuse_limit = max(run * seq.block_size - 1, 0)  # tokens: the kept blocks' but the last one's row
            # taken now: an entry evicted before the step's logprobs come back would leave a hole
            seq.kept_prompt_logprobs = self.prompt_logprobs.entries(hashes[:run], run * seq.block_size) if run else []
        return True

    def _allocate(self, seq: Sequence, match: PrefixMatch) -> None:
        """A waiting sequence's blocks (the cached prefix match found, fresh ones for the rest), and its adapter's
        slot."""
        self.block_manager.allocate(seq, match)
        if seq.lora is not None:
            self.lora_slots.take(seq, seq.lora)
        if seq.num_prompt_cached_tokens < 0:
            seq.num_prompt_cached_tokens = seq.num_cached_tokens

    def _fork_from_parent(self, seq: Sequence) -> bool | None:
        """Completion 1..n-1 of a request: fork its parent's prompt blocks once the parent has computed them
        (True). False: not forked, seq.parent kept while the parent's prompt is being computed (seq waits), else
        cleared (seq prefills as any request, prefix hits apply). None: no free block to fork into now."""
        parent, block_manager = seq.parent, self.block_manager
        if (parent.status == SequenceStatus.RUNNING and parent.num_cached_tokens >= parent.num_prompt_tokens
                and parent.long_rope == seq.long_rope and block_manager.can_fork(parent)):
            if not block_manager.free_block_ids:
                return None
            block_manager.fork(seq, parent)
            if seq.lora is not None:
                self.lora_slots.take(seq, seq.lora)  # its parent's: held while the parent runs
            seq.num_prompt_cached_tokens = parent.num_prompt_cached_tokens
            seq.parent = None
            return True
        if parent.is_finished or parent.num_cached_tokens >= parent.num_prompt_tokens:
            seq.parent = None  # nothing left to fork
        return False

    def _requeue_head(self, head: list[Sequence], chunked: Sequence | None) -> None:
        """After admissions from head: the others of it stay, in arrival order; a chunked prompt goes first (the
        only sequence of a batch that may be chunked is its first)."""
        waiting = self.waiting
        for _ in range(len(head)):
            waiting.popleft()
        waiting.extendleft(reversed([seq for seq in head if seq.status == SequenceStatus.WAITING
                                     and seq is not chunked]))
        if chunked is not None:
            waiting.appendleft(chunked)

    def _grow_for_chunk(self, seq: Sequence, token_budget: int) -> bool:
        """A prompt's next chunk where every layer slides: give back the blocks behind the window, then take
        those of the chunk's tokens (its first chunk took only its own). False if no free block is left for
        even one token; a chunk shortened to the free blocks takes the budget it then spends."""
        block_manager = self.block_manager
        block_manager.release_out_of_window(seq)
        block_size = block_manager.block_size
        end = min(seq.num_tokens, seq.num_cached_tokens + token_budget,
                  (len(seq.block_table) + block_manager.num_free_blocks) * block_size)
        if end <= seq.num_cached_tokens:
            return False
        for block_id in block_manager.grow(seq, end):
            if seq.on_workers:  # else its whole table goes with this step's message
                self.deltas.append(seq, block_id)
        return True

    def _admission_order(self, head: list[Sequence]) -> list[Sequence]:
        """head in the order to try: a partly prefilled sequence first, then, of the first
        ADMISSION_WINDOW, requests that waited MAX_WAIT_STEPS in arrival order and the rest by cached
        prefix, longest first (arrival order among equals); then the others in arrival order."""
        block_manager = self.block_manager
        if len(head) < 2 or not block_manager.enable_prefix_caching:
            return head
        oldest_fresh_step = self.num_steps - MAX_WAIT_STEPS
        num_cached_blocks = block_manager.num_cached_blocks

        def priority(seq: Sequence) -> tuple[int, int]:
            if seq.block_table:
                return 0, 0
            if seq.arrival_step <= oldest_fresh_step:
                return 1, 0
            return 2, -num_cached_blocks(seq)
        # stable: ties keep queue order
        return sorted(head[:ADMISSION_WINDOW], key=priority) + head[ADMISSION_WINDOW:]

    def _waits_for_batch(self, seq: Sequence, match: PrefixMatch, computing: HeadIndex) -> bool:
        """Whether seq should wait a step because this batch computes a longer head of its first
        uncached block than the cache holds (then, admitted next step, it reuses those tokens).

        Why this and not sharing within the step: the K/V seq would reuse is then written by an
        earlier step's forward, like any prefix hit's, so every attention backend reads it exactly
        as it reads a cached prefix. Reading K/V that another sequence of the same forward writes
        would rely on each backend storing before it reads, and the torch backend reads fresh K/V
        directly when a sequence has nothing cached.
        """
        block_size = self.block_manager.block_size
        k = len(match.block_ids)
        start = k * block_size
        head = seq.cache_keys(start, min(start + block_size, seq.num_tokens - 1))
        if not head:
            return False
        parent = seq.block_hashes[k - 1] if k else chain_root(seq)
        _, num_shared = computing.longest_match(parent, head)
        return num_shared - match.num_copied_tokens >= min(block_size, MIN_SHARED_TOKENS_TO_WAIT)

    def _note_computing(self, seq: Sequence, computing: HeadIndex) -> None:
        """Add the blocks seq writes in this step to computing, each as far as it will be written."""
        block_size = self.block_manager.block_size
        start = seq.num_cached_tokens
        end = start + seq.num_scheduled_tokens
        first, last = start // block_size, (end - 1) // block_size
        hashes = self.block_manager.block_hashes(seq, last)
        for i in range(first, last + 1):
            computing.add(hashes[i - 1] if i else chain_root(seq),
                          seq.cache_keys(i * block_size, min((i + 1) * block_size, end)), seq.seq_id)

    def _admit_rope_set(self, seq: Sequence) -> None:
        """LongRoPE: the factor set seq's K/V are computed with, taken as it is admitted (it holds no block): the
        long one when it has more tokens than the window, for every chunk of it. Its chain of block hashes
        follows the set (a sequence that passed the window since its last admission gets new hashes)."""
        long_rope = seq.num_tokens > self.long_rope_threshold
        if long_rope != seq.long_rope:
            seq.long_rope = long_rope
            seq.block_hashes = []

    def _rope_set_room(self, seq: Sequence) -> int:
        """How many tokens seq may still compute with its factor set beyond its next one (its drafts at most):
        a short LongRoPE sequence stays within the window; negative: its next token passes it."""
        if self.long_rope_threshold is None or seq.long_rope:
            return self.num_speculative_tokens
        return self.long_rope_threshold - seq.num_tokens

    def _schedule_decode(self) -> list[Sequence]:
        # This loop and postprocess run once per running sequence per step: locals are bound
        # up front and the common case (no new block needed) makes no function call.
        block_size = self.block_manager.block_size
        release_out_of_window = self.block_manager.sliding_window is not None and self.block_manager.release_out_of_window
        long_rope_threshold = self.long_rope_threshold
        running = self.running
        scheduled: list[Sequence] = []
        num_rows = min(len(running), self.max_num_seqs, self.max_num_batched_tokens)
        # draft tokens take only what the budget leaves once every row has its own token, in steps where
        # drafts pay
        spare_tokens, drafted = 0, False
        if self.speculation is not None and num_rows:
            spare_tokens = self.speculation.spare_tokens(num_rows, self.max_num_batched_tokens)
        for _ in range(num_rows):
            if not running:
                break  # preemptions emptied the queue
            seq = running.popleft()
            if long_rope_threshold is not None and self._rope_set_room(seq) < 0:
                self._preempt(seq)  # recomputed with the long set, as transformers' generate does
                continue
            # opens_block, inlined: only a sequence whose next token opens a new block can need a free one
            if seq.num_tokens % block_size == 1:
                if release_out_of_window:  # first give back what fell out of every layer's window
                    release_out_of_window(seq)
                if not self._append_block(seq):
                    break  # seq preempted itself: nothing else was running
            seq.num_scheduled_tokens = 1
            if spare_tokens > 0 and seq.speculates:
                taken = self._propose(seq, spare_tokens, first=not drafted)
                spare_tokens -= taken
                drafted = drafted or taken > 0
            scheduled.append(seq)
        running.extendleft(reversed(scheduled))
        return scheduled

    def _propose(self, seq: Sequence, spare_tokens: int, first: bool) -> int:
        """Give seq its draft tokens for this step, with their slots; returns how many tokens of the step's
        budget they take (with the draft model's K/V its sequence lacks: that runs in this step too; first: no
        other row of the step drafts yet). Drafts never take a free block that the next token of a running
        sequence not yet scheduled may need: speculation never preempts."""
        speculation, block_manager = self.speculation, self.block_manager
        block_size = block_manager.block_size
        spare_blocks = max(block_manager.num_free_blocks - len(self.running), 0)
        drafts = speculation.propose(seq, spare_tokens, first, self._rope_set_room(seq), spare_blocks, block_size)
        if not drafts:
            return 0
        for block_id in block_manager.grow(seq, seq.num_tokens + len(drafts)):
            self.deltas.append(seq, block_id)
        seq.draft_token_ids = drafts
        return speculation.catch_up_of(seq, block_size) + len(drafts)

    def _append_block(self, seq: Sequence) -> bool:
        """Give seq the block its next token opens, preempting from the tail of running while the
        cache is full. False if seq itself had to be preempted."""
        block_manager = self.block_manager
        while not block_manager.can_append(seq):
            if not self.running:
                self._preempt(seq)
                return False
            self._preempt(self.running.pop())  # the latest to run loses the least work
        self.deltas.append(seq, block_manager.may_append(seq))
        return True

    def _preempt(self, seq: Sequence) -> None:
        # Recompute: drop its blocks; its re-prefill can still hit them while they stay unwritten.
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self._release(seq)
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        """Free seq's blocks (and its adapter slot); every rank drops its table with the next step."""
        self.block_manager.deallocate(seq)
        self._give_back_lora_slot(seq)
        self.deltas.release(seq)

    def _give_back_lora_slot(self, seq: Sequence) -> None:
        if seq.lora_slot >= 0:
            self.lora_slots.give_back(seq)

    def postprocess(self, plan: StepPlan, token_ids: list[int],
                    draft_token_ids: list[int] = ()) -> tuple[list[Sequence], list[Sequence]]:
        """Account for the step `plan` just ran and append its sampled tokens (one per sampled row, in
        plan.sampling's order); returns the sequences that got a token (decode rows, prompts, verify rows: a
        verify row's sequence may get several), and those that finished. draft_token_ids: the verify rows'
        drafts, row after row, when the ranks' draft model proposed them."""
        decode, verify, prefill, _ = self._in_flight
        self._in_flight = None
        block_manager = self.block_manager
        if block_manager.block_copies:
            block_manager.release_copy_sources()  # the step ran: its copies are done
        completed = []  # prompts whose last chunk ran: their rows were sampled
        prompt_only = []  # embeddings and scored prompts whose prompt ran to its end: they are done
        for seq in prefill:
            self._cache_scheduled(seq)
            if seq.num_cached_tokens == seq.num_tokens:
                (prompt_only if seq.prompt_only else completed).append(seq)
        sampled = decode + completed if completed else decode
        assert len(sampled) + plan.num_verify_tokens == len(token_ids) == len(plan.sampling), \
            "tokens and sampled rows disagree"
        finished = []
        for seq in prompt_only:
            self.finish(seq, "stop" if seq.pooling is not None else "length")
            finished.append(seq)
        if verify:
            if self.proposer.on_ranks:
                self.speculation.take_drafts_made_on_ranks(verify, draft_token_ids, plan.num_verify_tokens)
            self._accept(verify, token_ids[len(sampled):], finished)
            token_ids = token_ids[:len(sampled)]
        self._append_sampled(sampled, token_ids, finished)
        for seq in prefill:
            if seq.block_table:  # not finished: its partly written last block can serve others
                block_manager.index_written_tail(seq)
        if self.speculation is not None:
            self.speculation.step_ran()
        return (sampled + verify if verify else sampled), finished

    def _cache_scheduled(self, seq: Sequence) -> None:
        """seq's scheduled tokens have their K/V written: they count as cached, and the blocks they filled enter
        the prefix cache (hash_blocks reads the counters before they move)."""
        num_cached_tokens = seq.num_cached_tokens + seq.num_scheduled_tokens
        if num_cached_tokens // self.block_manager.block_size != seq.num_cached_tokens // self.block_manager.block_size:
            self.block_manager.hash_blocks(seq)
        seq.num_cached_tokens = num_cached_tokens
        seq.num_scheduled_tokens = 0

    def _append_sampled(self, sampled: list[Sequence], token_ids: list[int], finished: list[Sequence]) -> None:
        """Append one token to each sampled decode row and completed prompt; finish those it ends."""
        # once per running sequence per step: locals bound up front, the common case calls one function
        block_size = self.block_manager.block_size
        hash_blocks = self.block_manager.hash_blocks
        self.num_output_tokens += len(sampled)
        for seq, token_id in zip(sampled, token_ids):
            if seq.num_scheduled_tokens:  # a decode row (a chunk's counters moved already): its K/V is cached
                # _cache_scheduled, inlined for one token: only a step that filled a block registers it
                num_cached_tokens = seq.num_cached_tokens + 1
                if num_cached_tokens % block_size == 0:
                    hash_blocks(seq)
                seq.num_cached_tokens = num_cached_tokens
                seq.num_scheduled_tokens = 0
            # finish_of's three triggers as one test first: most tokens end nothing, and this runs per row per step
            if ((token_id in seq.eos_and_stop_token_ids or seq.num_tokens + 1 >= seq.max_num_tokens or token_id < 0)
                    and self._ends(seq, token_id, finished)):
                continue
            # Sequence.append_token, inlined
            seq.token_ids.append(token_id)
            seq.last_token = token_id
            seq.num_tokens += 1

    def _ends(self, seq: Sequence, token_id: int, finished: list[Sequence]) -> bool:
        """Finish seq if its sampled token_id ends it (appended unless there is no token); False if not."""
        finish = finish_of(seq, token_id, seq.num_tokens + 1)
        if finish is None:
            return False
        if finish[0] != NO_TOKEN:
            seq.append_token(token_id)
        self.finish(seq, *finish)
        finished.append(seq)
        return True

    def _accept(self, verify: list[Sequence], token_ids: list[int], finished: list[Sequence]) -> None:
        """Append each verify row's kept tokens (Speculation.accepted), stopping at the first that ends the
        sequence. Only those tokens' K/V counts as cached and enters the hash chain; blocks that hold only
        rejected drafts' slots go back."""
        speculation, block_manager = self.speculation, self.block_manager
        block_size = block_manager.block_size
        speculation.verify_row_tokens = []
        row = 0
        for seq in verify:
            width = len(seq.draft_token_ids) + 1
            new_tokens, num_accepted = speculation.accepted(seq, token_ids[row:row + width])
            row += width
            finish = None
            for i, token_id in enumerate(new_tokens):
                finish = finish_of(seq, token_id, seq.num_tokens + i + 1)
                if finish is not None:
                    new_tokens = new_tokens[:i] if finish[0] == NO_TOKEN else new_tokens[:i + 1]
                    break
            seq.token_ids.extend(new_tokens)
            seq.num_tokens += len(new_tokens)
            if new_tokens:
                seq.last_token = new_tokens[-1]
            self.num_output_tokens += len(new_tokens)
            # cached now: the row's first token and the accepted drafts that became tokens of seq
            seq.num_scheduled_tokens = 1 + min(num_accepted, len(new_tokens))
            self._cache_scheduled(seq)
            if finish is not None:
                self.finish(seq, *finish)
                finished.append(seq)
                continue
            speculation.verify_row_tokens.append(len(new_tokens))
            num_blocks = blocks_for(seq.num_cached_tokens, block_size)
            if num_blocks < len(seq.block_table):
                block_manager.shrink(seq, num_blocks)
                self.deltas.truncate(seq, num_blocks)

    def observe_step(self, plan: StepPlan, num_new_tokens: int, seconds: float) -> None:
        """How long a step took from its plan to its tokens, for the draft policy (speculative decoding)."""
        if self.speculation is not None:
            self.speculation.observe_step(plan, num_new_tokens, seconds, bool(self.waiting))

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Drop seq's tokens after its first num_tokens (a verify row's past a stop string the engine matched,
        just before it finishes seq): it ends where it would have ended one token a step. Their K/V stays
        valid for the blocks the prefix cache registered, which hash the tokens they hold."""
        dropped = seq.num_tokens - num_tokens
        if dropped <= 0:
            return
        assert num_tokens > seq.num_prompt_tokens, "only sampled tokens are dropped"
        del seq.token_ids[num_tokens:]
        seq.num_tokens = num_tokens
        seq.last_token = seq.token_ids[-1]
        seq.num_cached_tokens = min(seq.num_cached_tokens, num_tokens - 1)
        seq.num_draft_cached_tokens = min(seq.num_draft_cached_tokens, seq.num_cached_tokens)
        self.num_output_tokens -= dropped

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """End a running sequence now and free its blocks (also for a stop string the engine matched)."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self._release(seq)
        self.running.remove(seq)

    def abort(self, seq_id: int) -> Sequence | None:
        """Drop a request wherever it is; returns it, or None if it is not queued."""
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.seq_id == seq_id:
                    queue.remove(seq)
                    if seq.block_table:
                        self._release(seq)
                    seq.status = SequenceStatus.FINISHED
                    seq.finish_reason = "abort"
                    return seq
        return None


def decode_position_offsets(decode: list[Sequence]) -> bytes:
    """What each decode row's position adds to its index (an image prompt's M-RoPE delta); b"" when none does."""
    offsets = [0 if seq.multimodal is None else seq.multimodal.position_delta for seq in decode]
    return int_column(offsets) if any(offsets) else b""


def cut_for_encoder(seq: Sequence, encoder_budget: int) -> int:
    """vLLM's encoder budget: the images whose placeholders start in seq's chunk are encoded this step, at most
    encoder_budget of their tokens; the chunk ends before an image past it (one that starts the chunk always runs,
    so an image larger than the budget runs alone). Returns the budget left (all of it for a text prompt)."""
    if seq.multimodal is None:
        return encoder_budget
    start = seq.num_cached_tokens
    for placement in seq.multimodal.images:
        if not start <= placement.offset < start + seq.num_scheduled_tokens:
            continue
        if placement.image.num_tokens > encoder_budget and placement.offset > start:
            seq.num_scheduled_tokens = placement.offset - start
            break
        encoder_budget -= placement.image.num_tokens
    if seq.multimodal.whole_images:
        keep_images_whole(seq)
    return encoder_budget


def keep_images_whole(seq: Sequence) -> None:
    """A chunk of a model whose image tokens attend to each other both ways never ends inside an image: it ends
    before an image that starts within it, or, where the image starts it (or a prefix hit ended inside it), runs to
    the image's end, past the step's token budget by less than one image (add_request bounds an image by it)."""
    start = seq.num_cached_tokens
    end = start + seq.num_scheduled_tokens
    for placement in seq.multimodal.images:
        if placement.offset < end < placement.end:
            seq.num_scheduled_tokens = (placement.offset if placement.offset > start else placement.end) - start
            return
