"""Scheduler: batching, chunked prefill, preemption, finishing, admission and abort, with fake sampled tokens."""
import random
from collections import Counter

import pytest

from tpengine.distributed.messages import int_list
from tpengine.engine.scheduler import MAX_WAIT_STEPS, Scheduler
from tpengine.engine.sequence import Sequence, SequenceStatus
from tpengine.engine.step_plan import StepPlan
from tpengine.outputs import NO_TOKEN
from tpengine.runner.block_tables import BlockTables
from tpengine.sampling_params import SamplingParams

BS = 4
EOS = 0
TOKEN = 7  # a fake sampled token that is not EOS


SEQ_BLOCK_SIZE = BS  # the block size of the sequences new_seq makes; tests at other sizes set it


def new_seq(token_ids: list[int], params: SamplingParams = SamplingParams(), **kwargs) -> Sequence:
    return Sequence(token_ids, params, SEQ_BLOCK_SIZE, **kwargs)


def make_scheduler(**overrides) -> Scheduler:
    # nano-vllm's policy unless a test says otherwise: most tests here pin down its step shapes
    kwargs = dict(num_kvcache_blocks=64, kvcache_block_size=BS, max_num_seqs=8, max_num_batched_tokens=64,
                  max_model_len=1024, eos_token_ids=frozenset([EOS]), scheduling_policy="prefill_first")
    kwargs.update(overrides)
    return Scheduler(**kwargs)


def add(scheduler: Scheduler, prompt_len: int, first_token: int = 1, **params) -> Sequence:
    """Check and queue a request, as the engine does."""
    seq = new_seq(list(range(first_token, first_token + prompt_len)), SamplingParams(**params))
    scheduler.check_fits(seq.num_prompt_tokens, seq.max_tokens)
    scheduler.add(seq)
    return seq


def schedule(scheduler: Scheduler) -> tuple[list[Sequence], bool, StepPlan]:
    """The next plan's rows (the scheduler's sequences for it) and whether it prefills anything, and the plan."""
    plan = scheduler.schedule()
    return scheduler.scheduled, bool(plan.message.prefill), plan


def is_sampled(seq: Sequence) -> bool:
    """Whether a scheduled row is sampled: a decode row, or a chunk that reaches its prompt's end."""
    return seq.num_cached_tokens + seq.num_scheduled_tokens == seq.num_tokens


def post(scheduler: Scheduler, plan: StepPlan, row_tokens: list[int]) -> list[Sequence]:
    """postprocess with one token per row of the plan (a row that is not sampled drops its own); returns
    the sequences that finished."""
    rows = scheduler.scheduled
    assert len(rows) == len(row_tokens)
    _, finished = scheduler.postprocess(plan, [t for seq, t in zip(rows, row_tokens) if is_sampled(seq)])
    return finished


def step(scheduler: Scheduler, token_id: int = TOKEN) -> tuple[list[Sequence], bool, list[Sequence]]:
    seqs, is_prefill, plan = schedule(scheduler)
    finished = post(scheduler, plan, [token_id] * len(seqs))
    return seqs, is_prefill, finished


def run_to_completion(scheduler: Scheduler, next_token=lambda seq: TOKEN, max_steps: int = 10_000) -> int:
    steps = 0
    while not scheduler.is_finished():
        plan = scheduler.schedule()
        post(scheduler, plan, [next_token(seq) for seq in scheduler.scheduled])
        steps += 1
        assert steps < max_steps
    return steps


def assert_all_blocks_free(scheduler: Scheduler) -> None:
    bm = scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not bm.used_block_ids
    assert all(block.ref_count == 0 for block in bm.blocks)


# --- batching -------------------------------------------------------------------------------

def test_a_waiting_prefill_is_scheduled_before_running_decodes():
    scheduler = make_scheduler()
    a = add(scheduler, 6)
    assert step(scheduler)[:2] == ([a], True)
    b = add(scheduler, 6, first_token=50)
    assert step(scheduler)[:2] == ([b], True)
    assert step(scheduler)[:2] == ([a, b], False)


def test_a_decode_step_computes_one_token_of_every_running_sequence():
    scheduler = make_scheduler()
    seqs = [add(scheduler, n, first_token=10 * n) for n in (3, 4, 5)]
    step(scheduler)
    batch, is_prefill, plan = schedule(scheduler)
    assert not is_prefill and batch == seqs == scheduler.scheduled
    assert all(seq.num_scheduled_tokens == 1 for seq in batch)
    assert all(seq.num_cached_tokens == seq.num_tokens - 1 for seq in batch)  # the sampled token
    post(scheduler, plan, [TOKEN] * 3)
    assert [seq.num_completion_tokens for seq in seqs] == [2, 2, 2]
    assert all(seq.num_cached_tokens == seq.num_tokens - 1 for seq in seqs)


def test_max_num_seqs_bounds_the_running_set_not_only_each_batch():
    scheduler = make_scheduler(max_num_seqs=2)
    seqs = [add(scheduler, 3, first_token=10 * i, max_tokens=2) for i in range(5)]
    batch, is_prefill, _ = step(scheduler)
    assert is_prefill and batch == seqs[:2]
    batch, is_prefill, finished = step(scheduler)  # two running: no third is admitted
    assert not is_prefill and batch == seqs[:2] and finished == seqs[:2]
    assert list(scheduler.running) == [] and list(scheduler.waiting) == seqs[2:]
    batch, is_prefill, _ = step(scheduler)  # room again: the next two are admitted
    assert is_prefill and batch == seqs[2:4]


def test_max_num_batched_tokens_limits_prefill_and_decode_batches():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    seqs = [add(scheduler, 5, first_token=10 * i) for i in range(4)]
    batch, is_prefill, _ = step(scheduler)
    assert is_prefill and batch == seqs[:3]  # 15 tokens; the fourth (5 > 1 left) waits
    assert step(scheduler)[0] == seqs[3:]
    scheduler = make_scheduler(max_num_batched_tokens=2)
    seqs = [add(scheduler, 1, first_token=10 * i) for i in range(3)]
    step(scheduler)
    step(scheduler)
    batch, is_prefill, _ = step(scheduler)
    assert not is_prefill and len(batch) == 2


# --- chunked prefill ------------------------------------------------------------------------

def test_chunked_prefill_spreads_a_long_prompt_across_steps():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    seq = add(scheduler, 20)
    for cached in (0, 8):
        batch, is_prefill, _ = step(scheduler)
        assert is_prefill and batch == [seq]
        assert seq.num_cached_tokens == cached + 8
        assert seq.num_tokens == 20  # nothing sampled before the last chunk
        assert scheduler.waiting[0] is seq and seq.status == SequenceStatus.WAITING
    batch, is_prefill, _ = step(scheduler)
    assert is_prefill and seq.num_cached_tokens == 20 and seq.num_tokens == 21
    assert list(scheduler.running) == [seq] and not scheduler.waiting


def test_a_chunked_first_sequence_leaves_no_room_for_the_next_in_that_step():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    a = add(scheduler, 14)
    b = add(scheduler, 3, first_token=50)
    batch, _, _ = step(scheduler)
    assert batch == [a] and a.num_cached_tokens == 10 and not b.block_table
    batch, _, _ = step(scheduler)
    assert batch == [a, b]  # a's last 4 tokens and all of b: 7 <= 10
    assert [seq.num_completion_tokens for seq in (a, b)] == [1, 1]


def test_a_second_sequence_that_does_not_fit_the_remaining_budget_waits_unchunked():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    a = add(scheduler, 6)
    b = add(scheduler, 6, first_token=50)
    batch, _, _ = step(scheduler)
    assert batch == [a]
    assert not b.block_table and b.num_cached_tokens == 0  # no blocks taken for it either
    batch, _, _ = step(scheduler)
    assert batch == [b] and b.num_scheduled_tokens == 0 and b.num_cached_tokens == 6


def test_a_prefix_hit_counts_only_the_uncached_tokens_against_the_budget():
    scheduler = make_scheduler(max_num_batched_tokens=12)
    a = add(scheduler, 9)
    step(scheduler)
    b = add(scheduler, 9)  # blocks 0 and 1 hit: 1 token to compute
    c = add(scheduler, 9, first_token=50)
    batch, is_prefill, _ = schedule(scheduler)
    assert is_prefill and batch == [b, c]  # 1 + 9 tokens fit a budget of 12
    assert [b.num_scheduled_tokens, c.num_scheduled_tokens] == [1, 9]
    assert b.num_prompt_cached_tokens == 8 and c.num_prompt_cached_tokens == 0
    assert a.block_table[:2] == b.block_table[:2]


# --- preemption -----------------------------------------------------------------------------

def test_a_full_cache_preempts_the_latest_sequence_by_recompute_and_it_still_finishes():
    scheduler = make_scheduler(num_kvcache_blocks=4)
    a = add(scheduler, 7, max_tokens=6)
    b = add(scheduler, 7, first_token=50, max_tokens=6)
    next_token = lambda seq: 100 + seq.num_completion_tokens  # noqa: E731 - position-tagged fake tokens
    seqs, _, plan = schedule(scheduler)
    post(scheduler, plan, [next_token(s) for s in seqs])  # both prefilled: 8 tokens, 2 blocks each
    assert scheduler.block_manager.num_free_blocks == 0
    seqs, _, plan = schedule(scheduler)
    post(scheduler, plan, [next_token(s) for s in seqs])  # 8 % 4 != 1: no new block yet
    seqs, is_prefill, plan = schedule(scheduler)  # both now need a 3rd block; only b's 2 can be freed
    assert not is_prefill and seqs == [a]
    assert scheduler.num_preemptions == 1
    assert list(scheduler.waiting) == [b] and b not in scheduler.running
    assert b.status == SequenceStatus.WAITING
    assert not b.block_table and b.num_cached_tokens == 0
    assert scheduler.block_manager.num_free_blocks == 1  # b's 2 blocks freed, 1 taken by a
    post(scheduler, plan, [next_token(s) for s in seqs])
    run_to_completion(scheduler, next_token)
    for seq in (a, b):
        assert seq.finish_reason == "length"
        assert seq.completion_token_ids == [100 + i for i in range(6)]
    assert_all_blocks_free(scheduler)


def test_preemption_takes_the_tail_of_running_first():
    scheduler = make_scheduler(num_kvcache_blocks=6)
    a, b, c = (add(scheduler, 7, first_token=10 * i, max_tokens=10) for i in range(1, 4))
    step(scheduler)  # all three prefilled: 8 tokens, 2 blocks each, cache full
    step(scheduler)
    batch, _, _ = step(scheduler)  # a needs a 3rd block: c goes; b then takes the other freed one
    assert batch == [a, b] and list(scheduler.waiting) == [c]
    assert list(scheduler.running) == [a, b]


def test_a_lone_sequence_never_needs_preempting_when_its_request_fits_the_cache():
    scheduler = make_scheduler(num_kvcache_blocks=3)
    seq = add(scheduler, 5, max_tokens=7)  # 12 tokens = 3 blocks at most
    run_to_completion(scheduler)
    assert seq.num_completion_tokens == 7 and scheduler.num_preemptions == 0


# --- finishing ------------------------------------------------------------------------------

def test_a_sequence_finishes_with_length_at_max_tokens():
    scheduler = make_scheduler()
    seq = add(scheduler, 5, max_tokens=3)
    finished = [step(scheduler)[2] for _ in range(3)]
    assert finished == [[], [], [seq]]
    assert seq.finish_reason == "length" and seq.num_completion_tokens == 3
    assert seq.status == SequenceStatus.FINISHED and scheduler.is_finished()
    assert_all_blocks_free(scheduler)


def test_a_sequence_finishes_with_stop_at_eos():
    scheduler = make_scheduler()
    seq = add(scheduler, 5, max_tokens=10)
    step(scheduler)
    _, _, finished = step(scheduler, token_id=EOS)
    assert finished == [seq] and seq.finish_reason == "stop"
    assert seq.completion_token_ids == [TOKEN, EOS]
    assert_all_blocks_free(scheduler)


def test_ignore_eos_generates_past_eos_until_max_tokens():
    scheduler = make_scheduler()
    seq = add(scheduler, 5, max_tokens=3, ignore_eos=True)
    run_to_completion(scheduler, lambda seq: EOS)
    assert seq.finish_reason == "length" and seq.completion_token_ids == [EOS] * 3


def test_a_sequence_finishes_with_stop_at_a_stop_token_id_even_with_ignore_eos():
    scheduler = make_scheduler()
    seq = add(scheduler, 5, max_tokens=10, stop_token_ids=(42,), ignore_eos=True)
    step(scheduler)
    _, _, finished = step(scheduler, token_id=42)
    assert finished == [seq] and seq.finish_reason == "stop"
    assert seq.completion_token_ids == [TOKEN, 42]


def test_a_sequence_finishes_with_length_at_max_model_len():
    scheduler = make_scheduler(max_model_len=10)
    seq = add(scheduler, 7, max_tokens=100)
    run_to_completion(scheduler)
    assert seq.finish_reason == "length" and seq.num_tokens == 10


def test_a_prompt_of_exactly_max_model_len_gets_one_token():
    scheduler = make_scheduler(max_model_len=8)
    seq = add(scheduler, 8, max_tokens=100)
    _, _, finished = step(scheduler)
    assert finished == [seq] and seq.finish_reason == "length" and seq.num_completion_tokens == 1


# --- admission ------------------------------------------------------------------------------

def test_a_prompt_longer_than_max_model_len_fails_the_check_and_queues_nothing():
    scheduler = make_scheduler(max_model_len=8)
    with pytest.raises(ValueError, match="max_model_len=8"):
        add(scheduler, 9)
    assert scheduler.is_finished()


def test_a_request_needing_more_blocks_than_the_cache_fails_the_check_and_queues_nothing():
    scheduler = make_scheduler(num_kvcache_blocks=4)  # 16 tokens
    with pytest.raises(ValueError, match="only 4 blocks"):
        add(scheduler, 10, max_tokens=10)
    assert scheduler.is_finished()
    add(scheduler, 10, max_tokens=6)  # 16 tokens fit


def test_max_model_len_caps_the_blocks_a_request_can_need():
    scheduler = make_scheduler(num_kvcache_blocks=4, max_model_len=16)
    seq = add(scheduler, 10, max_tokens=1000)
    run_to_completion(scheduler)
    assert seq.num_tokens == 16 and seq.finish_reason == "length"


# --- abort ----------------------------------------------------------------------------------

def test_abort_removes_a_waiting_sequence():
    scheduler = make_scheduler()
    a = add(scheduler, 5)
    b = add(scheduler, 5, first_token=50)
    assert scheduler.abort(b.seq_id) is b
    assert list(scheduler.waiting) == [a]
    assert b.finish_reason == "abort" and b.status == SequenceStatus.FINISHED


def test_abort_removes_a_running_sequence_and_frees_its_blocks():
    scheduler = make_scheduler()
    seq = add(scheduler, 9)
    step(scheduler)
    assert scheduler.abort(seq.seq_id) is seq
    assert scheduler.is_finished() and not seq.block_table
    assert_all_blocks_free(scheduler)


def test_abort_of_a_partly_prefilled_sequence_frees_its_blocks():
    scheduler = make_scheduler(max_num_batched_tokens=4)
    seq = add(scheduler, 9)
    step(scheduler)
    assert seq.block_table and seq in scheduler.waiting
    scheduler.abort(seq.seq_id)
    assert scheduler.is_finished()
    assert_all_blocks_free(scheduler)


def test_abort_of_an_unknown_id_returns_none():
    scheduler = make_scheduler()
    add(scheduler, 5)
    assert scheduler.abort(10**9) is None
    assert len(scheduler.waiting) == 1


# --- randomized simulation ------------------------------------------------------------------

def _check_step(scheduler: Scheduler, plan: StepPlan, kv: list[list], tables: BlockTables) -> None:
    """Limits hold, a rank's copy of the block tables (kept from the messages' changes alone) is every
    scheduled sequence's own, and a fake KV cache shows every token a sequence attends to is its own."""
    bm = scheduler.block_manager
    block_size = bm.block_size
    batch = scheduler.scheduled
    decode, prefill = batch[:plan.num_decode], batch[plan.num_decode:]
    assert batch and len(set(map(id, batch))) == len(batch)
    assert len(batch) <= scheduler.max_num_seqs
    assert plan.num_tokens == sum(seq.num_scheduled_tokens for seq in batch) <= scheduler.max_num_batched_tokens
    assert [(c.src, c.dst, c.num_tokens) for c in plan.message.block_copies] == scheduler.block_copies
    assert int_list(plan.message.decode_seq_ids) == [seq.seq_id for seq in decode]
    assert [chunk.seq_id for chunk in plan.message.prefill] == [seq.seq_id for seq in prefill]
    assert plan.sampling == [seq.sampling for seq in batch if is_sampled(seq)]
    assert all(tables.tables[seq.seq_id] == seq.block_table for seq in batch)
    held = {seq.seq_id for seq in (*scheduler.waiting, *scheduler.running) if seq.on_workers}
    assert held == set(tables.tables), "the ranks hold tables the ledger does not (a leak), or lack one"
    assert all(seq.num_scheduled_tokens == 1 and seq.num_cached_tokens == seq.num_tokens - 1 for seq in decode)
    if scheduler.scheduling_policy == "prefill_first":
        assert not (prefill and decode)
    elif prefill:  # mixed: a prompt chunk only after every running sequence has its token
        assert decode == list(scheduler.running)[:len(decode)] and len(decode) == len(
            [s for s in scheduler.running if s not in prefill])
    # block-head copies first, as every rank does before the forward; a source is pinned until they ran
    pins, copied_rows = Counter(), Counter()
    for src, dst, num_tokens in scheduler.block_copies:
        assert bm.blocks[src].ref_count > 0 and src not in bm.free_block_ids and bm.blocks[dst].ref_count == 1
        kv[dst][:num_tokens] = kv[src][:num_tokens]
        pins[src] += 1
        copied_rows[src] = max(copied_rows[src], num_tokens)
    for seq in batch:
        end = seq.num_cached_tokens + seq.num_scheduled_tokens
        assert seq.num_scheduled_tokens > 0 and end <= seq.num_tokens
        assert len(seq.block_table) >= (end + block_size - 1) // block_size
        for pos in range(seq.num_cached_tokens, end):
            block_id = seq.block_table[pos // block_size]
            # never write into a shared block; an owner may append to a block whose head is copied
            assert bm.blocks[block_id].ref_count - pins[block_id] == 1
            assert pos % block_size >= copied_rows[block_id]
            kv[block_id][pos % block_size] = seq.token_ids[pos]
    for seq in batch:
        end = seq.num_cached_tokens + seq.num_scheduled_tokens
        read = [kv[seq.block_table[pos // block_size]][pos % block_size] for pos in range(end)]
        assert read == seq.token_ids[:end]  # prefix hits and reused blocks hold the right K/V


def _check_ledger(scheduler: Scheduler, kv: list[list]) -> None:
    bm = scheduler.block_manager
    # every indexed head is in the index, and the (fake) cache really holds those tokens
    indexed = [block for block in bm.blocks if block.parent_hash is not None]
    assert len(bm.heads) == len(indexed)
    for block in indexed:
        assert bm.heads.longest_match(block.parent_hash, block.token_ids)[1] == len(block.token_ids)
        assert kv[block.block_id][:len(block.token_ids)] == block.token_ids
    assert not bm.block_copies  # pins last one step
    holders = [0] * bm.num_blocks
    for seq in (*scheduler.waiting, *scheduler.running):
        for block_id in seq.block_table:
            holders[block_id] += 1
    assert [block.ref_count for block in bm.blocks] == holders
    assert bm.used_block_ids == {i for i, n in enumerate(holders) if n}
    assert set(bm.free_block_ids) == {i for i, n in enumerate(holders) if not n}
    assert len(bm.free_block_ids) + len(bm.used_block_ids) == bm.num_blocks
    assert all(bm.blocks[block_id].hash == h for h, block_id in bm.hash_to_block_id.items())


@pytest.mark.parametrize("policy", ["mixed", "prefill_first"])
@pytest.mark.parametrize("seed", range(40))
def test_a_random_workload_terminates_without_leaking_blocks_or_exceeding_limits(monkeypatch, seed, policy):
    rng = random.Random(seed)
    block_size = rng.choice([2, 4, 8])
    monkeypatch.setitem(globals(), "SEQ_BLOCK_SIZE", block_size)
    scheduler = Scheduler(
        num_kvcache_blocks=rng.randint(6, 20), kvcache_block_size=block_size, max_num_seqs=rng.randint(1, 8),
        max_num_batched_tokens=rng.randint(4, 40), max_model_len=rng.randint(3 * block_size, 64),
        eos_token_ids=frozenset([EOS]), enable_prefix_caching=rng.random() < 0.8, scheduling_policy=policy)
    stems = [[rng.randrange(1, 4) for _ in range(40)] for _ in range(3)]  # shared prefixes: cache hits
    seqs = []
    for _ in range(rng.randint(10, 40)):
        prompt = rng.choice(stems)[:rng.randint(0, 30)] + [rng.randrange(1, 50) for _ in range(rng.randint(1, 12))]
        params = SamplingParams(max_tokens=rng.randint(1, 30), ignore_eos=rng.random() < 0.3,
                                stop_token_ids=(rng.randrange(1, 50),) if rng.random() < 0.3 else ())
        seq = new_seq(prompt, params)
        try:
            scheduler.check_fits(seq.num_prompt_tokens, seq.max_tokens)
        except ValueError:
            continue
        scheduler.add(seq)
        seqs.append(seq)
    kv = [[None] * block_size for _ in range(scheduler.block_manager.num_blocks)]
    tables = BlockTables()  # a rank's copy, kept from the messages alone
    steps = 0
    while not scheduler.is_finished():
        steps += 1
        assert steps < 5_000, "the scheduler stopped making progress"
        batch, _, plan = schedule(scheduler)
        if rng.random() < 0.02:  # interrupted (Ctrl-C in generate): the ranks may or may not have run it
            if rng.random() < 0.5:
                tables.update(plan.message)
            continue
        tables.update(plan.message)
        _check_step(scheduler, plan, kv, tables)
        token_ids = [EOS if rng.random() < 0.03 else rng.randrange(1, 50) for _ in batch]
        for seq in post(scheduler, plan, token_ids):
            assert seq.status == SequenceStatus.FINISHED and not seq.block_table
        queued = [*scheduler.waiting, *scheduler.running]
        if queued and rng.random() < 0.02:
            scheduler.abort(rng.choice(queued).seq_id)
        _check_ledger(scheduler, kv)
    assert_all_blocks_free(scheduler)
    for seq in seqs:
        assert seq.status == SequenceStatus.FINISHED
        assert 0 <= seq.num_completion_tokens <= seq.max_tokens
        if seq.finish_reason == "length":
            assert seq.num_completion_tokens == seq.max_tokens or seq.num_tokens >= scheduler.max_model_len
        elif seq.finish_reason == "stop":
            last = seq.completion_token_ids[-1]
            assert last in seq.sampling_params.stop_token_ids or (last == EOS and not seq.ignore_eos)
        else:
            assert seq.finish_reason == "abort"


@pytest.mark.parametrize("policy", ["mixed", "prefill_first"])
@pytest.mark.parametrize("seed", range(6))
def test_random_shared_prefixes_arriving_over_time_keep_every_invariant(monkeypatch, seed, policy):
    assert _run_shared_prefixes_over_time(monkeypatch, seed, policy) > 0 or policy == "mixed"


def test_mixed_steps_preempt_in_some_shared_prefix_workloads(monkeypatch):
    assert any(_run_shared_prefixes_over_time(monkeypatch, seed, "mixed") for seed in range(6))


def _run_shared_prefixes_over_time(monkeypatch, seed: int, policy: str) -> int:
    """Prompts cut from a few stems around block edges arrive while others run, finish, get preempted
    (a small cache) and aborted; every step the fake cache proves each reused token is the right one."""
    rng = random.Random(1000 + seed)
    block_size = rng.choice([4, 8])
    monkeypatch.setitem(globals(), "SEQ_BLOCK_SIZE", block_size)
    scheduler = Scheduler(
        num_kvcache_blocks=rng.randint(40 // block_size, 96 // block_size), kvcache_block_size=block_size,
        max_num_seqs=rng.randint(2, 8), max_num_batched_tokens=rng.randint(16, 64), max_model_len=40,
        eos_token_ids=frozenset([EOS]), scheduling_policy=policy)
    stems = [[rng.randrange(1, 4) for _ in range(5 * block_size)] for _ in range(3)]
    edges = [k * block_size + d for k in range(1, 4) for d in (-1, 0, 1, block_size // 2)]
    kv = [[None] * block_size for _ in range(scheduler.block_manager.num_blocks)]
    tables = BlockTables()
    num_arrivals, steps, num_copies = 60, 0, 0
    while num_arrivals or not scheduler.is_finished():
        if num_arrivals and rng.random() < 0.5:
            num_arrivals -= 1
            prompt = rng.choice(stems)[:rng.choice(edges)] + [rng.randrange(1, 50) for _ in range(rng.randint(0, 6))]
            scheduler.add(new_seq(prompt or [1], SamplingParams(max_tokens=rng.randint(1, 12))))
        steps += 1
        assert steps < 5_000, "the scheduler stopped making progress"
        batch, _, plan = schedule(scheduler)
        if not batch:
            continue
        num_copies += len(scheduler.block_copies)
        tables.update(plan.message)
        _check_step(scheduler, plan, kv, tables)
        post(scheduler, plan, [rng.randrange(1, 4) for _ in batch])
        queued = [*scheduler.waiting, *scheduler.running]
        if queued and rng.random() < 0.03:
            scheduler.abort(rng.choice(queued).seq_id)
        _check_ledger(scheduler, kv)
    assert_all_blocks_free(scheduler)
    bm = scheduler.block_manager
    assert num_copies > 0 and bm.prefix_cache_hits > 0
    return scheduler.num_preemptions


# --- prefix sharing within a step, cache-aware admission ------------------------------------

def test_a_request_sharing_what_the_batch_computes_waits_one_step_then_reuses_it():
    scheduler = make_scheduler()
    shared = list(range(100, 110))  # two whole blocks of 4 and half a block
    a, b, c = new_seq(shared + [1, 2]), new_seq(shared + [3, 4]), new_seq([50, 51, 52])
    for seq in (a, b, c):
        scheduler.add(seq)
    batch, _, _ = step(scheduler)
    assert batch == [a, c]  # b would compute a's prefix a second time
    batch, is_prefill, _ = schedule(scheduler)
    assert batch == [b] and is_prefill
    assert b.num_cached_tokens == b.num_prompt_cached_tokens == 10  # to the token
    assert scheduler.block_copies == [(a.block_table[2], b.block_table[2], 2)]
    assert b.block_table[:2] == a.block_table[:2]


def test_a_request_with_no_hit_is_overtaken_only_until_it_has_waited_max_wait_steps():
    scheduler = make_scheduler(max_num_seqs=1)
    cached = list(range(100, 120))
    add(scheduler, 20, first_token=100, max_tokens=1)
    step(scheduler)  # now cached; it finished at its first token
    cold = add(scheduler, 3, first_token=500, max_tokens=1)  # queued after step 1
    admitted = []
    for i in range(2 * MAX_WAIT_STEPS):
        scheduler.add(new_seq(cached + [1000 + i], SamplingParams(max_tokens=1)))  # a hit arrives every step
        batch, _, _ = step(scheduler)
        admitted.extend(batch)
    # hits go first while cold is young; once it has waited MAX_WAIT_STEPS nothing overtakes it
    assert admitted.index(cold) == MAX_WAIT_STEPS - 1
    assert all(seq.num_prompt_cached_tokens == 20 for seq in admitted[:MAX_WAIT_STEPS - 1])


def test_without_prefix_caching_admission_is_first_come_first_served():
    scheduler = make_scheduler(max_num_seqs=1, enable_prefix_caching=False)
    add(scheduler, 20, first_token=100, max_tokens=1)
    step(scheduler)
    cold = add(scheduler, 3, first_token=500, max_tokens=1)
    scheduler.add(new_seq(list(range(100, 120)) + [7], SamplingParams(max_tokens=1)))
    assert step(scheduler)[0] == [cold]


def test_prefix_cache_counters_and_kv_usage_are_read_from_the_scheduler():
    scheduler = make_scheduler(num_kvcache_blocks=16)
    a = add(scheduler, 9, max_tokens=4)
    step(scheduler)
    assert scheduler.kv_cache_usage == 3 / 16
    add(scheduler, 9, max_tokens=4)
    step(scheduler)
    assert (scheduler.prefix_cache_queries, scheduler.prefix_cache_hits) == (9 + 9, 0 + 8)
    scheduler.abort(a.seq_id)
    assert scheduler.kv_cache_usage == 3 / 16  # the second request's own blocks, shared ones included


def test_a_row_the_sampler_could_not_sample_ends_that_sequence_only_with_no_token():
    scheduler = make_scheduler()
    bad, good = add(scheduler, 5), add(scheduler, 6, first_token=50, max_tokens=3)  # one batch: no shared prefix
    finished = post(scheduler, scheduler.schedule(), [-1, TOKEN])
    assert finished == [bad] and bad.finish_reason == NO_TOKEN and bad.completion_token_ids == []
    run_to_completion(scheduler)
    assert good.finish_reason == "length" and scheduler.block_manager.num_free_blocks == 64


def test_min_tokens_keeps_a_stop_token_from_ending_the_sequence_early():
    scheduler = make_scheduler()
    seq = add(scheduler, 3, max_tokens=10, min_tokens=3)
    run_to_completion(scheduler, next_token=lambda s: EOS)
    assert seq.completion_token_ids == [EOS] * 3 and seq.finish_reason == "stop" and seq.stop_reason is None


def test_a_listed_stop_token_is_the_stop_reason():
    scheduler = make_scheduler()
    seq = add(scheduler, 3, stop_token_ids=[9])
    run_to_completion(scheduler, next_token=lambda s: 9)
    assert seq.finish_reason == "stop" and seq.stop_reason == 9


@pytest.mark.parametrize("prompt_len", [9, 8, 1])  # last block partly filled, exactly full, one token
def test_a_child_forks_its_parents_prompt_blocks_once_the_prompt_is_computed(prompt_len):
    scheduler = make_scheduler()
    parent = new_seq(list(range(1, prompt_len + 1)), SamplingParams(n=2))
    child = new_seq(list(range(1, prompt_len + 1)), SamplingParams(n=2), index=1, parent=parent)
    scheduler.add(parent)
    scheduler.add(child)
    seqs, is_prefill, plan = schedule(scheduler)
    assert seqs == [parent] and is_prefill  # the child waits for the prompt instead of computing it too
    post(scheduler, plan, [TOKEN])
    seqs, is_prefill, plan = schedule(scheduler)
    assert seqs == [child] and is_prefill and child.num_scheduled_tokens == 1
    last = (prompt_len - 1) // BS
    assert child.block_table[:last] == parent.block_table[:last]  # shared
    assert child.block_table[last] != parent.block_table[last]
    num_copied = (prompt_len - 1) % BS
    assert scheduler.block_copies == ([(parent.block_table[last], child.block_table[last], num_copied)]
                                      if num_copied else [])
    assert all(scheduler.block_manager.blocks[b].ref_count == 2 for b in parent.block_table[:last])
    post(scheduler, plan, [TOKEN])
    run_to_completion(scheduler)
    assert scheduler.block_manager.num_free_blocks == 64


def test_a_child_whose_parent_already_finished_prefills_as_any_request():
    scheduler = make_scheduler()
    parent = new_seq(list(range(1, 10)), SamplingParams(n=2, max_tokens=1))
    child = new_seq(list(range(1, 10)), SamplingParams(n=2, max_tokens=1), index=1, parent=parent)
    scheduler.add(parent)
    scheduler.add(child)
    step(scheduler)
    assert parent.is_finished
    seqs, _, finished = step(scheduler)
    assert seqs == [child] and finished == [child] and child.num_prompt_cached_tokens == 8  # two cached blocks


def test_a_short_longrope_sequence_about_to_pass_the_window_is_recomputed_with_the_long_set():
    # LongRoPE over an 8-token window: a prompt of 6 is short; the token that makes it 9 tokens long is not decoded
    # but recomputed, the whole sequence as a long prompt (as transformers' generate does)
    scheduler = make_scheduler(long_rope_threshold=8)
    seq = add(scheduler, 6, max_tokens=10, ignore_eos=True)
    _, _, plan = schedule(scheduler)
    assert not seq.long_rope and not plan.message.prefill[0].long_rope
    post(scheduler, plan, [TOKEN])
    short_hashes = list(seq.block_hashes)
    for context_len in (7, 8):  # decodes while its context stays within the window
        rows, is_prefill, plan = schedule(scheduler)
        assert rows == [seq] and not is_prefill and int_list(plan.message.decode_context_lens) == [context_len]
        post(scheduler, plan, [TOKEN])
    assert seq.num_tokens == 9
    rows, is_prefill, plan = schedule(scheduler)
    assert scheduler.num_preemptions == 1 and is_prefill and rows == [seq] and seq.long_rope
    chunk, = plan.message.prefill
    assert chunk.long_rope and chunk.num_cached_tokens == 0 and len(chunk.token_ids) == 9  # no short block reused
    assert seq.block_hashes[:1] != short_hashes[:1]  # its chain follows the long set
    post(scheduler, plan, [TOKEN])
    rows, is_prefill, plan = schedule(scheduler)  # long from now on: decoded past the window
    assert rows == [seq] and not is_prefill and int_list(plan.message.decode_context_lens) == [10]
    assert run_to_completion(scheduler) and scheduler.num_preemptions == 1
    assert_all_blocks_free(scheduler)


def test_short_and_long_longrope_sequences_never_share_blocks():
    scheduler = make_scheduler(long_rope_threshold=8, scheduling_policy="mixed")
    long_seq = add(scheduler, 12, max_tokens=1)
    step(scheduler)  # its blocks cached under the long set's root
    short_seq = add(scheduler, 8, max_tokens=1)  # the same first 8 tokens
    again = add(scheduler, 12, max_tokens=1)
    rows, _, plan = schedule(scheduler)
    assert long_seq.is_finished and {*rows} == {short_seq, again}
    chunks = {chunk.seq_id: chunk for chunk in plan.message.prefill}
    assert chunks[short_seq.seq_id].num_cached_tokens == 0 and not chunks[short_seq.seq_id].long_rope
    assert chunks[again.seq_id].num_cached_tokens == 11 and chunks[again.seq_id].long_rope


def test_a_short_longrope_sequence_s_drafts_stop_at_the_window():
    from tpengine.config import SpeculativeConfig
    from tpengine.engine.proposer import NgramProposer
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                        "prompt_lookup_max": 3})
    scheduler = make_scheduler(long_rope_threshold=8, scheduling_policy="mixed", proposer=NgramProposer(spec),
                               num_speculative_tokens=4)
    seq = new_seq([5] * 6, SamplingParams(max_tokens=10, ignore_eos=True))
    scheduler.add(seq)
    step(scheduler, 5)
    _, _, plan = schedule(scheduler)
    # 7 tokens: its last and one draft reach the window's 8; the ngram had 4 to give
    assert seq.draft_token_ids == [5] and plan.message.prefill[0].num_draft_tokens == 1
