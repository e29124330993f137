"""Speculative decoding in the ledger: n-gram proposals, verify rows, rejection sampling and the block
ledger under random accept/reject, driven by a Markov-chain "model" whose next-token distribution depends
on the last token only (so every sampled row's logits are known exactly); config and refusals."""
import dataclasses
import random

import msgspec
import pytest
import torch

from tests.engine.test_scheduler import BS, make_scheduler, new_seq
from tpengine.config import SpeculativeConfig
from tpengine.distributed.messages import BlockTable, PrefillChunk, StepMessage, int_list
from tpengine.engine.block_manager import compute_block_hash
from tpengine.engine.draft_policy import DraftPolicy
from tpengine.engine.proposer import DraftModelProposer, NgramProposer
from tpengine.engine.sequence import SequenceStatus
from tpengine.paging import blocks_for
from tpengine.runner.block_tables import BlockTables
from tpengine.runner.sampler import Sampler
from tpengine.sampling_params import SamplingParams

VOCAB = 6


def ngram(k: int = 4, lo: int = 1, hi: int = 3) -> SpeculativeConfig:
    return SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lo,
                                        "prompt_lookup_max": hi})


def markov_chain(seed: int) -> torch.Tensor:
    """[VOCAB, VOCAB] transition probabilities, peaked so tokens loop (n-gram's home ground), none 0 or 1."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(VOCAB, VOCAB, generator=g) * 2.0).softmax(-1)


def sampled_row_tokens(plan) -> list[int]:
    """The input token of every sampled row of a plan, in row order: its logits depend on it alone here."""
    message = plan.message
    tokens = int_list(message.decode_tokens)
    for chunk in message.prefill:
        if chunk.sampled:
            tokens += chunk.token_ids[len(chunk.token_ids) - 1 - chunk.num_draft_tokens:]
    return tokens


def drafted_on_ranks(message: StepMessage, draft: torch.Tensor) -> tuple[StepMessage, list[int]]:
    """What the ranks' draft model does with a step (runner/drafter.py), a chain's argmax as the draft: each
    verify row that carries only its last token gets its drafts, greedily one after another."""
    prefill, drafts = [], []
    for chunk in message.prefill:
        if chunk.num_draft_tokens and len(chunk.token_ids) == 1:
            proposed = [chunk.token_ids[0]]
            for _ in range(chunk.num_draft_tokens):
                proposed.append(int(draft[proposed[-1]].argmax()))
            chunk = PrefillChunk(chunk.seq_id, proposed, chunk.num_cached_tokens, True, chunk.num_draft_tokens)
            drafts += proposed[1:]
        prefill.append(chunk)
    return msgspec.structs.replace(message, prefill=prefill), drafts


def run(scheduler, transitions: torch.Tensor, sampler: Sampler, check=None, draft: torch.Tensor | None = None) -> int:
    """Run every queued sequence to its end with the chain as the model (and draft's argmax as the draft model's,
    for a proposer on the ranks); returns the steps taken."""
    log_transitions = transitions.log()
    tables = BlockTables()
    steps = 0
    while not scheduler.is_finished():
        plan = scheduler.schedule()
        tables.update(plan.message)
        # every rank's tables, as the step's message leaves them, are the ledger's
        on_workers = {seq.seq_id: seq.block_table for seq in (*scheduler.running, *scheduler.waiting)
                      if seq.on_workers}
        assert tables.tables == on_workers
        drafts = []
        if scheduler.proposer is not None and scheduler.proposer.on_ranks:
            message, drafts = drafted_on_ranks(plan.message, draft)
            plan = dataclasses.replace(plan, message=message)
        tokens = sampled_row_tokens(plan)
        assert len(tokens) == len(plan.sampling)
        sampled = sampler(log_transitions[tokens], plan.sampling).token_ids if tokens else []
        scheduler.postprocess(plan, sampled, drafts)
        if check is not None:
            check(scheduler, tables)
        steps += 1
        assert steps < 100_000
    return steps


# --- the proposer ---------------------------------------------------------------------------

def test_ngram_proposes_what_followed_the_latest_earlier_occurrence_of_the_longest_suffix():
    proposer = NgramProposer(ngram(hi=3))
    assert proposer.propose([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3], 3) == [7, 8, 1]  # latest of [1, 2, 3]
    assert proposer.propose([5, 2, 3, 4, 6, 3], 2) == [4, 6]  # only the 1-gram [3] occurred before
    assert proposer.propose([1, 2, 3, 4], 3) == []
    assert proposer.propose([4, 4], 5) == [4] * 5  # past the sequence's end, what followed loops
    assert proposer.propose([1, 2, 3, 1, 2], 5) == [3, 1, 2, 3, 1]
    assert NgramProposer(ngram(lo=2, hi=3)).propose([5, 2, 3, 4, 6, 3], 2) == []


def test_ngram_matches_only_whole_tokens():
    # 256 and 1 share bytes with 1 and 0 at other offsets: a byte search alone would find false hits
    proposer = NgramProposer(ngram(lo=2, hi=2))
    assert proposer.propose([1, 256, 0, 1, 0, 1, 256], 2) == [0, 1]
    assert proposer.propose([256, 1, 7, 0, 1, 1], 2) == []


# --- verification ---------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_and_seeded_sampled_sequences_get_the_same_tokens_with_and_without_speculation(method):
    transitions = markov_chain(0)
    draft = markov_chain(10)  # another chain: its argmax agrees with the model's on some tokens only
    outputs = {}
    for spec in (None, ngram() if method == "ngram" else draft_model()):
        scheduler = make_scheduler(scheduling_policy="mixed", num_kvcache_blocks=40,
                                   **speculation(spec))
        seqs = []
        for i in range(12):
            params = SamplingParams(temperature=0.0 if i % 3 == 0 else 0.8, seed=None if i % 3 == 0 else i,
                                    top_p=0.9 if i % 4 == 1 else 1.0, max_tokens=30, ignore_eos=True)
            seqs.append(new_seq([i % VOCAB, (i * 7) % VOCAB, 1], params))
            scheduler.add(seqs[-1])
        run(scheduler, transitions, Sampler(seed=5), draft=draft)
        outputs[spec is None] = [seq.completion_token_ids for seq in seqs]
        if spec is not None:
            assert 0 < scheduler.num_accepted_tokens < scheduler.num_draft_tokens  # both outcomes happened
    assert outputs[True] == outputs[False]


def speculation(spec: SpeculativeConfig | None) -> dict:
    if spec is None:
        return {}
    proposer = DraftModelProposer() if spec.method == "draft_model" else NgramProposer(spec)
    return dict(proposer=proposer, num_speculative_tokens=spec.num_speculative_tokens)


def draft_model(k: int = 4) -> SpeculativeConfig:
    return SpeculativeConfig.from_dict({"model": "/a/draft", "num_speculative_tokens": k})


def test_speculative_sampling_follows_the_distribution_plain_sampling_does():
    """Unseeded: speculation draws other random numbers, so only the distribution can agree. Each position's
    marginal and the last pair's joint, over 1500 sequences, against the chain's exact ones."""
    transitions = markov_chain(1)
    num_seqs, length, start = 1500, 6, 2
    scheduler = make_scheduler(scheduling_policy="mixed", num_kvcache_blocks=2000, max_num_seqs=512,
                               max_num_batched_tokens=4096, **speculation(ngram(k=3)))
    seqs = [new_seq([3, 1, 3, 1, start], SamplingParams(temperature=1.0, max_tokens=length, ignore_eos=True))
            for _ in range(num_seqs)]
    for seq in seqs:
        scheduler.add(seq)
    run(scheduler, transitions, Sampler(seed=7))
    assert 0.05 * scheduler.num_draft_tokens < scheduler.num_accepted_tokens < scheduler.num_draft_tokens
    tokens = torch.tensor([seq.completion_token_ids for seq in seqs])
    marginal = torch.nn.functional.one_hot(torch.tensor(start), VOCAB).double()
    for position in range(length):
        joint = marginal.unsqueeze(1) * transitions.double()  # P(x_{t-1}, x_t)
        marginal = joint.sum(0)
        freq = torch.bincount(tokens[:, position], minlength=VOCAB).double() / num_seqs
        assert torch.allclose(freq, marginal, atol=0.045), (position, freq, marginal)
    pairs = torch.bincount(tokens[:, -2] * VOCAB + tokens[:, -1], minlength=VOCAB * VOCAB).double() / num_seqs
    assert torch.allclose(pairs, joint.flatten(), atol=0.035)


# --- the ledger -----------------------------------------------------------------------------

def check_ledger(scheduler, tables: BlockTables) -> None:
    """After every step: reference counts are the holders, free and used blocks partition the cache, a
    running sequence holds exactly the blocks of its cached tokens, and those its accepted tokens fill are
    in its hash chain (run checks every rank's tables against the ledger's)."""
    bm = scheduler.block_manager
    holders = {}
    for seq in (*scheduler.running, *scheduler.waiting):
        for block_id in seq.block_table:
            holders[block_id] = holders.get(block_id, 0) + 1
        assert not seq.draft_token_ids
    for block in bm.blocks:
        assert block.ref_count == holders.get(block.block_id, 0)
    assert bm.used_block_ids == set(holders)
    assert set(bm.free_block_ids) == set(range(bm.num_blocks)) - set(holders)
    for seq in scheduler.running:
        assert seq.num_cached_tokens == seq.num_tokens - 1
        assert len(seq.block_table) == blocks_for(seq.num_cached_tokens, BS)
        h = -1
        for i, block_id in enumerate(seq.block_table[:seq.num_cached_tokens // BS]):
            h = compute_block_hash(seq.token_ids[i * BS:(i + 1) * BS], h)
            assert bm.blocks[block_id].hash == h  # every block its accepted tokens fill, in its chain
        for block_id in seq.block_table[seq.num_cached_tokens // BS:]:
            assert bm.blocks[block_id].hash == -1  # the partly filled block is never in the chain


@pytest.mark.parametrize("seed, method", [(0, "ngram"), (1, "ngram"), (2, "ngram"), (3, "ngram"),
                                          (0, "draft_model"), (1, "draft_model")])
def test_ledger_stays_consistent_under_random_accept_reject_preemption_and_abort(seed, method):
    """A small cache (preemptions), prefix sharing, stop tokens, random aborts between steps; greedy rows of
    a chain give long accepted runs, sampled ones rejections (a draft model: the chain's own argmax, so
    greedy rows accept every draft)."""
    rng = random.Random(seed)
    transitions = markov_chain(seed)
    spec = ngram(k=5) if method == "ngram" else draft_model(k=5)
    scheduler = make_scheduler(scheduling_policy="mixed", num_kvcache_blocks=24, max_num_seqs=6,
                               max_num_batched_tokens=24, **speculation(spec))
    sampler = Sampler(seed=seed)
    queued = []
    for i in range(20):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 14))]
        params = SamplingParams(temperature=rng.choice([0.0, 0.7, 1.5]), max_tokens=rng.randrange(1, 40),
                                stop_token_ids=[5] if i % 5 == 0 else None, ignore_eos=True)
        seq = new_seq(prompt, params)
        scheduler.check_fits(seq.num_prompt_tokens, seq.max_tokens)
        scheduler.add(seq)
        queued.append(seq)

    def check(scheduler, tables):
        check_ledger(scheduler, tables)
        if rng.random() < 0.05 and scheduler.running:
            scheduler.abort(rng.choice(list(scheduler.running)).seq_id)

    run(scheduler, transitions, sampler, check, draft=transitions)
    assert scheduler.num_preemptions > 0 and scheduler.num_accepted_tokens > 0
    assert all(seq.status == SequenceStatus.FINISHED for seq in queued)
    for seq in queued:
        if seq.finish_reason == "length":
            assert seq.num_completion_tokens == seq.max_tokens
        elif seq.finish_reason == "stop":
            assert seq.completion_token_ids[-1] == 5 and 5 not in seq.completion_token_ids[:-1]
    bm = scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not bm.used_block_ids


def test_an_interrupted_verify_step_gives_back_its_draft_blocks_and_runs_again():
    scheduler = make_scheduler(scheduling_policy="mixed", **speculation(ngram(k=5)))
    bm = scheduler.block_manager
    seq = new_seq([1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(temperature=0.0, max_tokens=20))
    scheduler.add(seq)
    scheduler.postprocess(scheduler.schedule(), [3])
    table, num_free = list(seq.block_table), bm.num_free_blocks
    scheduler.schedule()
    assert seq.draft_token_ids == [1, 2, 3, 1, 2] and len(seq.block_table) == 4  # slots for 14 tokens
    plan = scheduler.schedule()  # the last step never reached postprocess: undone, then planned again
    assert plan.message.reset_tables and plan.message.new_tables == [BlockTable(seq.seq_id, seq.block_table)]
    assert seq.draft_token_ids == [1, 2, 3, 1, 2] and len(seq.block_table) == 4
    assert seq.block_table[:2] == table and bm.num_free_blocks == num_free - 2


# --- config ---------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, message", [
    ({"model": "/some/draft"}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "method 'draft_model' needs \"model\""),
    ({"model": "/some/draft", "num_speculative_tokens": 3, "prompt_lookup_max": 2},
     "['prompt_lookup_max'] apply to method 'ngram' only"),
    ({"method": "ngram", "model": "/some/draft", "num_speculative_tokens": 3}, "which method 'ngram' does not take"),
    ({"method": "ngram", "num_speculative_tokens": 3, "adaptive": "yes"}, "adaptive must be true or false"),
    ({"model": "/some/draft", "num_speculative_tokens": 3, "disable_by_batch_size": 0},
     "disable_by_batch_size must be an integer >= 1"),
    ({"method": "eagle", "num_speculative_tokens": 3}, "method must be one of"),
    ({"method": "ngram"}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 3, "lookahead": 2}, "unknown keys ['lookahead']"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min=4 is more than prompt_lookup_max=2"),
])
def test_speculative_configs_the_engine_cannot_run_are_refused_by_name(spec, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SpeculativeConfig.from_dict(spec)


def test_draft_model_config_is_vllms():
    assert SpeculativeConfig.from_dict({"model": "/a/draft", "num_speculative_tokens": 2}) == SpeculativeConfig(
        method="draft_model", num_speculative_tokens=2, model="/a/draft")
    assert SpeculativeConfig.from_dict({"method": "draft_model", "model": "/a/draft", "num_speculative_tokens": 2}) \
        == SpeculativeConfig.from_dict({"model": "/a/draft", "num_speculative_tokens": 2})


def test_ngram_config_takes_vllms_defaults():
    assert SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2}) == SpeculativeConfig(
        method="ngram", num_speculative_tokens=2, prompt_lookup_min=5, prompt_lookup_max=5)
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (3, 3)


class RecordingPolicy(DraftPolicy):
    """Every step drafts (not adaptive); what the scheduler reports of each step is kept."""

    def __init__(self):
        super().__init__(adaptive=False)
        self.observed: list[tuple[int, bool, float]] = []

    def observe(self, num_rows: int, drafted: bool, tokens_per_row: float, seconds: float) -> None:
        self.observed.append((num_rows, drafted, tokens_per_row))


@pytest.mark.parametrize("waiting", [False, True])
def test_a_step_with_drafts_counts_its_slower_half_of_rows_while_no_request_waits_for_a_row(waiting):
    # a batch that is not refilled ends with its slower rows; one that is gains every row's tokens
    policy = RecordingPolicy()
    scheduler = make_scheduler(max_num_seqs=4, num_kvcache_blocks=40, draft_policy=policy,
                               **speculation(draft_model(k=4)))
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for i in range(4 + waiting):  # the fifth waits: four rows at most
        scheduler.add(new_seq([1 + i, 2, 3], params))
    plan = scheduler.schedule()
    scheduler.postprocess(plan, [4] * len(plan.sampling))
    scheduler.observe_step(plan, 4, 0.01)
    assert policy.observed == []  # a step with prompts is not measured
    plan = scheduler.schedule()
    assert [chunk.num_draft_tokens for chunk in plan.message.prefill] == [4, 4, 4, 4]
    drafts = [5, 5, 5, 5] * 4
    # the rows keep 4, 0, 2 and 4 of their drafts: 5, 1, 3 and 5 tokens
    sampled = [5, 5, 5, 5, 1] + [2, 1, 1, 1, 1] + [5, 5, 2, 1, 1] + [5, 5, 5, 5, 1]
    scheduler.postprocess(plan, sampled, drafts)
    scheduler.observe_step(plan, 14, 0.01)
    assert policy.observed == [(4, True, 3.5 if waiting else 2.0)]  # the slower half: 1 and 3


class DraftsLate(DraftPolicy):
    """No drafts in the first `after` steps that ask, drafts in every one after."""

    def __init__(self, after: int):
        super().__init__(adaptive=False)
        self.after, self.asked = after, 0

    def drafts_pay(self, num_rows: int) -> bool:
        self.asked += 1
        return self.asked > self.after


def run_late_drafts(num_seqs: int, budget: int) -> list[tuple[int, int]]:
    """Sequences that draft only after 40 steps, each then lacking 40 tokens of draft K/V, run to their end;
    returns each step's (tokens in its forward, draft K/V included, and verify rows)."""
    transitions, draft = markov_chain(3), markov_chain(13)
    scheduler = make_scheduler(scheduling_policy="mixed", max_num_batched_tokens=budget, num_kvcache_blocks=60,
                               draft_policy=DraftsLate(40), **speculation(draft_model(k=4)))
    for i in range(num_seqs):
        scheduler.add(new_seq([i, 1, 2, 3], SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)))
    log_transitions, sampler = transitions.log(), Sampler(seed=0)
    steps = []
    while not scheduler.is_finished():
        plan = scheduler.schedule()
        # a verify row carries its last token and how many drafts the ranks make, with what the draft lacks
        chunks = plan.message.prefill
        steps.append((plan.message.num_decode_rows + sum(len(chunk.token_ids) + chunk.num_draft_tokens
                                                            + len(chunk.draft_context) for chunk in chunks),
                      sum(1 for chunk in plan.message.prefill if chunk.num_draft_tokens)))
        message, drafts = drafted_on_ranks(plan.message, draft)
        plan = dataclasses.replace(plan, message=message)
        scheduler.postprocess(plan, sampler(log_transitions[sampled_row_tokens(plan)], plan.sampling).token_ids,
                              drafts)
    return steps


def test_the_draft_models_catch_up_stays_within_the_steps_token_budget():
    # the verify rows that write what they lack in one step fit its budget with everything else, and the
    # others draft in later steps
    steps = run_late_drafts(4, budget=64)
    assert all(tokens <= 64 for tokens, _ in steps)
    verify_rows = [rows for _, rows in steps]
    first = next(i for i, n in enumerate(verify_rows) if n)
    assert verify_rows[first] < 4 and max(verify_rows) == 4  # all caught up, over steps


def test_a_sequence_left_a_whole_budget_behind_still_catches_up_as_a_steps_first_verify_row():
    steps = run_late_drafts(1, budget=24)
    first = next(i for i, (_, rows) in enumerate(steps) if rows)
    assert first == 41 and steps[first][0] > 24  # after the prefill and 40 steps: 40 tokens of draft K/V at once
