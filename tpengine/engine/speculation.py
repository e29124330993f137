"""Speculative decoding's share of the ledger: which rows take drafts and how many, the verify rows' chunks, which
drafts are kept, and the counters vLLM's spec_decode_* metrics report.

A running sequence whose request allows it (engine/proposer.py) gets, instead of a decode row, a verify row: its
last token and up to num_speculative_tokens proposed tokens (drafts), each with a slot, sent as one chunk whose
every row is sampled (a draft model's drafts are made on the ranks within the step: the chunk carries their
number, and they come back with the tokens). Sampling a row exactly as it would be sampled without speculation
and keeping the drafts up to the first that differs from its row's token is rejection sampling for a proposal
that is one token for sure: a draft x is kept with probability p(x), else the row's token follows p without x.
So greedy and seeded requests get the very tokens they get without speculation, and every request the same
distribution."""
from tpengine.distributed.messages import PrefillChunk
from tpengine.engine.draft_policy import DraftPolicy
from tpengine.engine.proposer import Proposer
from tpengine.engine.sequence import Sequence
from tpengine.engine.step_plan import StepPlan
from tpengine.sampling_params import SamplingRecord


def draft_context_start(seq: Sequence, block_size: int) -> int:
    """Where the K/V the ranks' draft model lacks for seq starts (none behind a sliding window: those blocks are
    given back); a verify row carries seq's tokens from there to its cached end."""
    return max(seq.num_draft_cached_tokens, seq.num_released_blocks * block_size)


class Speculation:
    def __init__(self, proposer: Proposer, num_speculative_tokens: int, draft_policy: DraftPolicy | None):
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens  # drafts a verify row takes at most
        # which steps take drafts (the engine's measures step times; without one, every step does)
        self.draft_policy = draft_policy or DraftPolicy(adaptive=False)
        # whether the last decode step drafted: while steps do not, the ranks' draft model skips prompt chunks too
        self.drafting = True
        # a step the ranks' draft model runs in: the sequences whose draft K/V is complete once it has run
        self.draft_caught_up: list[Sequence] = []
        self.verify_row_tokens: list[int] = []  # the last step's: tokens each verify row still running got
        # the counters: verify rows with drafts, drafts, accepted drafts, and accepted drafts by position in a row
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * num_speculative_tokens

    def spare_tokens(self, num_rows: int, max_num_batched_tokens: int) -> int:
        """The budget drafts may take in a decode step of num_rows rows: what is left once every row has its own
        token, in steps where drafts pay (the policy decides per step)."""
        self.drafting = self.draft_policy.drafts_pay(num_rows)
        return max_num_batched_tokens - num_rows if self.drafting else 0

    def propose(self, seq: Sequence, spare_tokens: int, first: bool, room_for_rope: int, num_spare_blocks: int,
                block_size: int) -> list[int]:
        """seq's drafts for this step (first: no other row of the step drafts yet), without their slots: never
        past the sequence's length limit or its rope set's room, nor past the slots its table and the spare free
        blocks give (speculation never preempts). A draft model's catch-up on K/V the sequence lacks runs in the
        step too and takes budget (draft_budget_cost)."""
        if self.proposer.on_ranks:
            # a sequence that did not draft for a long while has much to catch up on: within what the step's
            # budget leaves, or it drafts in a later step; the step's first verify row takes all it lacks (at
            # most max_model_len tokens), or a sequence left a whole budget behind would never draft again
            catch_up = self.catch_up_of(seq, block_size)
            spare_tokens = max(spare_tokens - catch_up, self.num_speculative_tokens) if first \
                else spare_tokens - catch_up
        max_drafts = min(self.num_speculative_tokens, spare_tokens, seq.max_num_tokens - seq.num_tokens - 1,
                         room_for_rope)
        drafts = self.proposer.propose(seq.token_ids, max_drafts) if max_drafts > 0 else []
        room = (len(seq.block_table) + num_spare_blocks) * block_size - seq.num_tokens  # slots it may have
        return drafts[:room]

    def catch_up_of(self, seq: Sequence, block_size: int) -> int:
        """Tokens of seq's draft-model K/V a verify row writes first (the ranks' draft model only)."""
        if not self.proposer.on_ranks or not self.proposer.catches_up:
            return 0
        return seq.num_cached_tokens - draft_context_start(seq, block_size)

    def add_verify_rows(self, decode: list[Sequence], verify: list[Sequence], prefill: list[Sequence],
                        chunks: list[PrefillChunk], sampling: list[SamplingRecord], block_size: int) -> int:
        """Append the verify rows' chunks and sampled rows' records (after the prompt chunks: the rows sampled
        before them keep their order); returns their tokens."""
        on_ranks = self.proposer.on_ranks
        if on_ranks and (verify or prefill):
            # the ranks' draft model runs over every row of a step that drafts, and over the prompt chunks of a
            # step that does not while steps draft (its share of a prefill is then needed soon): the rows whose
            # draft K/V is complete stay so, and each verify row first writes what it lacks
            mirrored = (*decode, *prefill) if verify else (prefill if self.drafting else ())
            self.draft_caught_up = [seq for seq in mirrored
                                    if seq.num_draft_cached_tokens == seq.num_cached_tokens] + verify
        num_verify_tokens = 0
        for seq in verify:
            drafts = seq.draft_token_ids
            if on_ranks:  # the context a catching-up proposer lacks (none for one that follows every step)
                start = draft_context_start(seq, block_size) if self.proposer.catches_up else seq.num_cached_tokens
                chunks.append(PrefillChunk(seq.seq_id, [seq.last_token], seq.num_cached_tokens, True, len(drafts),
                                           seq.long_rope, start, seq.token_ids[start:seq.num_cached_tokens],
                                           seq.lora_slot))
            else:
                chunks.append(PrefillChunk(seq.seq_id, [seq.last_token, *drafts], seq.num_cached_tokens, True,
                                           len(drafts), seq.long_rope, lora_slot=seq.lora_slot))
            num_verify_tokens += 1 + len(drafts)
            sampling.append(seq.sampling)
            sampling.extend(seq.sampling.ahead(i) for i in range(1, len(drafts) + 1))
        return num_verify_tokens

    def take_drafts_made_on_ranks(self, verify: list[Sequence], draft_token_ids: list[int],
                                  num_verify_tokens: int) -> None:
        """The ranks' draft model proposed the verify rows' drafts within the step: each row's, in row order."""
        assert len(draft_token_ids) == num_verify_tokens - len(verify), "drafts and verify rows disagree"
        at = 0
        for seq in verify:
            seq.draft_token_ids = draft_token_ids[at:at + len(seq.draft_token_ids)]
            at += len(seq.draft_token_ids)

    def accepted(self, seq: Sequence, samples: list[int]) -> tuple[list[int], int]:
        """A verify row's new tokens before any finish check: its drafts up to the first that differs from its
        row's sampled token, then that token (or the one after the last draft); and how many drafts were kept.
        Counts them."""
        drafts = seq.draft_token_ids
        seq.draft_token_ids = []
        num_accepted = 0
        while num_accepted < len(drafts) and samples[num_accepted] == drafts[num_accepted]:
            num_accepted += 1
        self.num_drafts += 1
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1
        # the accepted drafts are their rows' samples; the next sample is verification's own token
        return samples[:num_accepted + 1], num_accepted

    def step_ran(self) -> None:
        """The draft K/V of the sequences the step's draft model covered is complete (those still running)."""
        if self.draft_caught_up:
            for seq in self.draft_caught_up:
                if seq.block_table:
                    seq.num_draft_cached_tokens = seq.num_cached_tokens
            self.draft_caught_up = []

    def observe_step(self, plan: StepPlan, num_new_tokens: int, seconds: float, requests_wait: bool) -> None:
        """How long a step took from its plan to its tokens, for the draft policy: one of decode and verify rows
        alone."""
        if plan.num_prefill_tokens:
            return
        num_verify_rows = sum(1 for chunk in plan.message.prefill if chunk.num_draft_tokens)
        num_rows = plan.num_decode + num_verify_rows
        tokens_per_row = num_new_tokens / num_rows if num_rows else 0.0
        if num_verify_rows and not requests_wait:
            # No request waits for a row, so a row that gets ahead is not refilled and the batch ends with its
            # slower rows: a step with drafts counts the mean tokens of the slower half of its rows still running
            # (a decode row among them got one), or rows far ahead would hide the ones left behind.
            tokens = sorted(self.verify_row_tokens + [1] * plan.num_decode)
            if tokens:
                slower = tokens[:(len(tokens) + 1) // 2]
                tokens_per_row = min(tokens_per_row, sum(slower) / len(slower))
        self.draft_policy.observe(num_rows, bool(num_verify_rows), tokens_per_row, seconds)

