"""Where every layer slides, the ledger gives back the blocks behind the window as sequences grow: a long
decode holds a bounded number of blocks, released blocks stay hittable, forks and preemption still work."""
import pytest

from tests.engine.test_scheduler import TOKEN, make_scheduler, post
from tpengine.engine.sequence import Sequence, SequenceStatus
from tpengine.paging import blocks_for
from tpengine.sampling_params import SamplingParams

BS = 4


def run(scheduler, max_steps=10_000, check=lambda: None):
    """Step with fake tokens until every request finished, calling check after each step."""
    for _ in range(max_steps):
        if scheduler.is_finished():
            return
        plan = scheduler.schedule()
        post(scheduler, plan, [TOKEN] * len(scheduler.scheduled))
        check()
    raise AssertionError("did not finish")


def held(seq) -> int:
    return sum(1 for block_id in seq.block_table if block_id != -1)


@pytest.mark.parametrize("window", [1, 4, 9, 16])
def test_a_sliding_only_sequence_holds_at_most_window_over_block_plus_two_blocks(window):
    scheduler = make_scheduler(sliding_window=window, kvcache_block_size=BS, num_kvcache_blocks=128)
    seq = Sequence(list(range(1, 11)), SamplingParams(max_tokens=400, ignore_eos=True), BS)
    scheduler.add(seq)
    most = []

    def check():
        if seq.block_table and seq.num_tokens > seq.num_prompt_tokens + BS:  # its prompt's chunk is one step
            most.append(held(seq))
            # every block the next token sees is still held
            first_seen = max(0, seq.num_cached_tokens - window + 1) // BS
            assert all(block_id != -1 for block_id in seq.block_table[first_seen:])
        bm = scheduler.block_manager
        assert bm.num_free_blocks + len(bm.used_block_ids) == bm.num_blocks
    run(scheduler, check=check)
    assert max(most) <= window // BS + 2
    assert scheduler.block_manager.num_free_blocks == 128


def test_without_a_window_every_block_stays():
    scheduler = make_scheduler(kvcache_block_size=BS)
    seq = Sequence(list(range(1, 11)), SamplingParams(max_tokens=50, ignore_eos=True), BS)
    scheduler.add(seq)
    for _ in range(30):
        plan = scheduler.schedule()
        post(scheduler, plan, [TOKEN] * len(scheduler.scheduled))
    assert -1 not in seq.block_table and held(seq) == blocks_for(seq.num_tokens, BS)


def test_chunked_prompt_releases_between_chunks_and_released_blocks_stay_hittable():
    scheduler = make_scheduler(sliding_window=8, kvcache_block_size=BS, max_num_batched_tokens=8,
                               scheduling_policy="mixed")
    prompt = list(range(1, 41))
    first = Sequence(prompt, SamplingParams(max_tokens=1), BS)
    scheduler.add(first)
    chunks = 0
    while first.status != SequenceStatus.FINISHED:
        plan = scheduler.schedule()
        if first in scheduler.scheduled and first.num_cached_tokens >= 16:  # a later chunk released its past
            assert first.block_table[0] == -1
        chunks += 1
        post(scheduler, plan, [TOKEN] * len(scheduler.scheduled))
    assert chunks == 5
    # the released blocks kept their hashes: the same prompt again hits all but its last token
    second = Sequence(prompt, SamplingParams(max_tokens=1), BS)
    scheduler.add(second)
    scheduler.schedule()
    assert second.num_cached_tokens == len(prompt) - 1


def test_a_child_forks_a_parent_within_the_window_and_prefills_alone_past_it():
    # n=2 completions: the second forks the first's prompt while the first has released nothing it needs
    scheduler = make_scheduler(sliding_window=4, kvcache_block_size=BS, enable_prefix_caching=False,
                               scheduling_policy="mixed")
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    parent = Sequence(list(range(1, 22)), params, BS)
    child = Sequence(list(range(1, 22)), params, BS, index=1, parent=parent)
    scheduler.add(parent)
    scheduler.add(child)
    run(scheduler)
    assert parent.num_tokens == child.num_tokens == 51
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks


def run_three(window, num_blocks=8):
    """Three requests of 10 + 20 tokens through a cache of num_blocks blocks of 4; the scheduler, after."""
    scheduler = make_scheduler(sliding_window=window, kvcache_block_size=BS, num_kvcache_blocks=num_blocks,
                               scheduling_policy="mixed")
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    seqs = [Sequence(list(range(1 + i, 11 + i)), params, BS) for i in range(3)]
    for seq in seqs:
        scheduler.check_fits(seq.num_prompt_tokens, seq.max_tokens)
        scheduler.add(seq)
    run(scheduler)
    assert all(seq.num_tokens == 30 for seq in seqs)
    bm = scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not bm.used_block_ids  # released blocks were not freed twice
    return scheduler


def test_preemption_with_released_blocks_gives_back_only_what_is_held():
    assert run_three(window=16).num_preemptions > 0  # each holds up to 6 blocks: two do not fit in 8


def test_released_blocks_serve_other_requests_instead_of_preempting():
    assert run_three(window=None).num_preemptions > 0
    assert run_three(window=4).num_preemptions == 0  # each holds at most 3 blocks once its prompt ran


@pytest.mark.parametrize("policy", ["mixed", "prefill_first"])
def test_a_prompt_many_times_the_cache_runs_chunk_by_chunk(policy):
    # 12 blocks of 4 hold 48 tokens; the prompt has 200: its chunks of 8 take blocks as they go
    scheduler = make_scheduler(sliding_window=8, kvcache_block_size=BS, num_kvcache_blocks=12,
                               max_num_batched_tokens=8, scheduling_policy=policy)
    seq = Sequence(list(range(1, 201)), SamplingParams(max_tokens=50, ignore_eos=True), BS)
    scheduler.check_fits(seq.num_prompt_tokens, seq.max_tokens)
    scheduler.add(seq)
    most = []

    def check():
        most.append(held(seq))
        first_seen = max(0, seq.num_cached_tokens - 8 + 1) // BS
        assert all(block_id != -1 for block_id in seq.block_table[first_seen:])
    run(scheduler, check=check)
    assert seq.num_tokens == 250 and scheduler.num_preemptions == 0
    assert max(most) <= (8 + 8) // BS + 2


def test_check_fits_counts_the_window_and_a_step_where_every_layer_slides():
    scheduler = make_scheduler(sliding_window=8, kvcache_block_size=BS, num_kvcache_blocks=6,
                               max_num_batched_tokens=8)
    scheduler.check_fits(1000, 1000)  # (8 + 8 + 6) // 4 + 1 = 6 blocks at once
    with pytest.raises(ValueError, match="needs 7 KV-cache blocks at once .the sliding window of 8 tokens and a "
                                         "step's 12. of 4 tokens, but the whole cache has only 6 blocks"):
        make_scheduler(sliding_window=8, kvcache_block_size=BS, num_kvcache_blocks=6,
                       max_num_batched_tokens=12).check_fits(1000, 1000)


def test_a_prefix_hit_behind_the_window_takes_only_the_blocks_it_sees():
    scheduler = make_scheduler(sliding_window=8, kvcache_block_size=BS, num_kvcache_blocks=64,
                               max_num_batched_tokens=64, scheduling_policy="mixed")
    prompt = list(range(1, 41))
    first = Sequence(prompt, SamplingParams(max_tokens=1), BS)
    scheduler.add(first)
    run(scheduler)
    second = Sequence(prompt + [99, 98], SamplingParams(max_tokens=1), BS)
    scheduler.add(second)
    scheduler.schedule()
    assert second.num_cached_tokens == 40
    # position 40 on sees keys from 40 - 8 + 1 = 33 on (one of slack: 32): blocks 0-7 are not taken
    assert second.block_table[:8] == [-1] * 8 and -1 not in second.block_table[8:]
    assert len(scheduler.block_manager.used_block_ids) == 3


def test_a_prefix_hit_needs_only_the_blocks_its_next_token_sees():
    from tests.engine.test_block_manager import assert_consistent, prefill
    from tpengine.engine.block_manager import BlockManager
    bm = BlockManager(14, BS, sliding_window=8)
    prompt = list(range(100, 140))  # 10 blocks
    first = prefill(bm, prompt)
    bm.release_out_of_window(first)  # as the scheduler does: blocks 0-7 go back, 0 first
    bm.deallocate(first)
    # 4 never-used blocks, then first's blocks 0 and 1 are taken and overwritten
    for tokens in (list(range(16)), list(range(200, 205))):
        other = Sequence(tokens, SamplingParams(), BS)
        bm.allocate(other, bm.can_allocate(other))
    again = Sequence(prompt + [1, 2], SamplingParams(), BS)
    assert bm.num_cached_blocks(again) == 10  # admission's score counts the hit too
    match = bm.can_allocate(again)
    # the next token (position 40) sees blocks 8 and 9: cached; 2-7 are too, and none is taken
    assert match.num_cached_tokens == 40 and match.block_ids[:8] == [-1] * 8
    bm.allocate(again, match)
    assert again.block_table[:8] == [-1] * 8 and again.num_released_blocks == 8
    assert_consistent(bm)
