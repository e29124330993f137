"""A step message carries only what changed in the block tables; a rank that keeps its tables from those
changes builds exactly the forward inputs it would from a message carrying every row's whole table,
through random schedules with preemptions, prefix-cache copies, forks, aborts and interrupted steps."""
import dataclasses
import random

import msgspec
import pytest
import torch

from tests.engine.test_scheduler import is_sampled, new_seq
from tpengine.config import SpeculativeConfig
from tpengine.distributed.messages import BlockTable
from tpengine.engine.proposer import NgramProposer
from tpengine.engine.scheduler import Scheduler
from tpengine.platforms.cpu import row_bucket
from tpengine.runner.inputs import InputBuilder
from tpengine.sampling_params import SamplingParams

EOS = 0


def speculation(rng: random.Random) -> dict:
    k = rng.randint(1, 5)
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
                                        "prompt_lookup_max": rng.randint(1, 3)})
    return dict(proposer=NgramProposer(spec), num_speculative_tokens=k)


def whole(message, rows):
    """The same step with every row's whole table, on ranks that first drop every table they hold."""
    return msgspec.structs.replace(message, reset_tables=True, released=[], appended_seq_ids=[], appended_block_ids=[],
                               truncated_seq_ids=[], truncated_num_blocks=[],
                               new_tables=[BlockTable(seq.seq_id, list(seq.block_table)) for seq in rows])


def assert_same_inputs(a, b) -> None:
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.positions, b.positions)
    assert a.num_logits == b.num_logits
    assert (a.logits_rows is None) == (b.logits_rows is None)
    if a.logits_rows is not None:
        assert torch.equal(a.logits_rows, b.logits_rows)
    metas = [(a.meta, b.meta)]
    if a.meta.decode is not None or b.meta.decode is not None:
        metas.append((a.meta.decode, b.meta.decode))
    for x, y in metas:
        for field in dataclasses.fields(x):
            u, v = getattr(x, field.name), getattr(y, field.name)
            if isinstance(u, torch.Tensor):
                assert torch.equal(u, v), field.name
            elif field.name != "decode":
                assert u == v, field.name


def sampled_tokens(rng: random.Random, rows) -> list[int]:
    """Fake tokens for every sampled row; a verify row's rows follow its drafts for a while (accepted), then
    may not (rejected)."""
    tokens = []
    for seq in rows:
        if seq.draft_token_ids:
            num_accepted = rng.randint(0, len(seq.draft_token_ids))
            tokens += seq.draft_token_ids[:num_accepted]
            tokens += [rng.randrange(1, 5) for _ in range(len(seq.draft_token_ids) + 1 - num_accepted)]
        elif is_sampled(seq):
            tokens.append(EOS if rng.random() < 0.05 else rng.randrange(1, 5))  # few: n-grams recur
    return tokens


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("policy", ["mixed", "prefill_first"])
@pytest.mark.parametrize("seed", range(12))
def test_inputs_from_the_tables_a_rank_keeps_equal_inputs_from_whole_tables(monkeypatch, seed, policy, speculative):
    rng = random.Random(seed)
    block_size = rng.choice([2, 4, 8])
    monkeypatch.setattr("tests.engine.test_scheduler.SEQ_BLOCK_SIZE", block_size)
    scheduler = Scheduler(
        num_kvcache_blocks=rng.randint(8, 24), kvcache_block_size=block_size, max_num_seqs=rng.randint(1, 8),
        max_num_batched_tokens=rng.randint(4, 40), max_model_len=rng.randint(3 * block_size, 64),
        eos_token_ids=frozenset([EOS]), enable_prefix_caching=rng.random() < 0.8, scheduling_policy=policy,
        **speculation(rng) if speculative else {})
    stems = [[rng.randrange(1, 4) for _ in range(40)] for _ in range(3)]  # shared prefixes: copies and hits
    for _ in range(rng.randint(10, 30)):
        prompt = rng.choice(stems)[:rng.randint(0, 30)] + [rng.randrange(1, 50) for _ in range(rng.randint(1, 12))]
        n = rng.choice([1, 1, 2])
        params = SamplingParams(n=n, max_tokens=rng.randint(1, 20), ignore_eos=rng.random() < 0.3)
        parent = new_seq(prompt, params)
        seqs = [parent] + [new_seq(prompt, params, index=i, parent=parent) for i in range(1, n)]
        try:
            scheduler.check_fits(parent.num_prompt_tokens, params.max_tokens)
        except ValueError:
            continue
        for seq in seqs:
            scheduler.add(seq)
    incremental = InputBuilder(block_size, torch.device("cpu"))
    full = InputBuilder(block_size, torch.device("cpu"))
    steps = interrupted = 0
    while not scheduler.is_finished():
        steps += 1
        assert steps < 5_000
        plan = scheduler.schedule()
        rows = scheduler.scheduled
        if not rows:
            continue
        a = incremental.prepare(plan.message)
        b = full.prepare(whole(plan.message, rows))
        assert_same_inputs(a, b)
        assert a.input_ids.numel() == row_bucket(plan.num_tokens)
        if rng.random() < 0.03:  # interrupted after the ranks built their inputs: never postprocessed
            interrupted += 1
            continue
        scheduler.postprocess(plan, sampled_tokens(rng, rows))
        queued = [*scheduler.waiting, *scheduler.running]
        if queued and rng.random() < 0.03:
            scheduler.abort(rng.choice(queued).seq_id)
    if speculative:
        assert scheduler.num_drafts > 0  # verify rows ran
    # the tables a rank keeps hold no sequence that left (the releases of the last steps wait for a next one)
    assert set(incremental.block_tables.tables) <= set(scheduler.deltas.released)


def test_a_verify_row_runs_as_decode_queries_over_its_growing_context_and_is_sampled_after_the_prompts():
    from tpengine.distributed.messages import PrefillChunk, StepMessage, int_column
    builder = InputBuilder(4, torch.device("cpu"))
    # seq 1 decodes its 6th token; seq 2 has 5 tokens cached and verifies its last token and 2 drafts
    # (positions 5..7, across its blocks 1 and 2); seq 3 prefills a 3-token prompt
    step = StepMessage(int_column([1]), int_column([11]), int_column([6]),
                       [PrefillChunk(3, [31, 32, 33], 0, True), PrefillChunk(2, [21, 22, 23], 5, True, 2)],
                       new_tables=[BlockTable(1, [0, 1]), BlockTable(2, [2, 3, 4]), BlockTable(3, [5])])
    inputs = builder.prepare(step)
    assert inputs.input_ids.tolist()[:4] == [11, 21, 22, 23] and inputs.input_ids.tolist()[-3:] == [31, 32, 33]
    assert inputs.positions.tolist()[:4] == [5, 5, 6, 7]
    decode = inputs.meta.decode
    assert decode.context_lens.tolist()[:4] == [6, 6, 7, 8]
    assert decode.slot_mapping.tolist()[:4] == [1 * 4 + 1, 3 * 4 + 1, 3 * 4 + 2, 3 * 4 + 3]
    num_decode = inputs.meta.num_decode_tokens  # padding rows included
    # sampled in the plan's order: the decode row, the prompt's last row, then the verify row's three
    assert inputs.num_logits == 5
    assert inputs.logits_rows.tolist()[:5] == [0, num_decode + 2, 1, 2, 3]
    # without a prompt the step is a decode step, sampled in row order
    inputs = builder.prepare(StepMessage(int_column([1]), int_column([12]), int_column([7]),
                                             [PrefillChunk(2, [23, 24], 7, True, 1)]))
    assert not inputs.meta.is_prefill and inputs.logits_rows is None and inputs.num_logits == 3
    assert inputs.meta.context_lens.tolist()[:3] == [7, 8, 9]
    assert inputs.meta.slot_mapping.tolist()[:3] == [1 * 4 + 2, 3 * 4 + 3, 4 * 4 + 0]


def test_longrope_rows_past_the_window_and_long_chunks_take_their_position_plus_max_positions():
    from tpengine.distributed.messages import PrefillChunk, StepMessage, int_column
    builder = InputBuilder(4, torch.device("cpu"), long_rope_threshold=6, max_positions=100)
    # decode rows attending to 6 (within the window) and 7 tokens; a verify row from context 6 to 8 (the rule is
    # per row: the ledger never sends one across the window); a short
    # prompt chunk, then the chunk of a long prompt
    step = StepMessage(int_column([1, 2]), int_column([11, 21]), int_column([6, 7]),
                       [PrefillChunk(4, [41, 42], 0, True), PrefillChunk(5, [51, 52], 4, False, long_rope=True),
                        PrefillChunk(3, [31, 32, 33], 5, True, 2)],
                       new_tables=[BlockTable(1, [0, 1]), BlockTable(2, [2, 3]), BlockTable(3, [4, 5, 6]),
                                   BlockTable(4, [7]), BlockTable(5, [8, 9])])
    inputs = builder.prepare(step)
    num_decode = inputs.meta.num_decode_tokens
    positions = inputs.positions.tolist()
    assert positions[:5] == [5, 106, 5, 106, 107]
    assert positions[num_decode:] == [0, 1, 104, 105]
