"""BlockManager: one test per rule of the seed design (ref counts, FIFO free queue, hash chain, prefix hits)."""
from array import array

import pytest
import xxhash

from tpengine.engine.block_manager import BlockManager, compute_block_hash
from tpengine.engine.sequence import Sequence
from tpengine.sampling_params import SamplingParams

BS = 4  # small blocks keep the arithmetic readable


SEQ_BLOCK_SIZE = BS  # the block size of the sequences new_seq makes; tests at other sizes set it


def new_seq(token_ids: list[int], params: SamplingParams = SamplingParams(), **kwargs) -> Sequence:
    return Sequence(token_ids, params, SEQ_BLOCK_SIZE, **kwargs)


def prefill(bm: BlockManager, token_ids: list[int]) -> Sequence:
    """Allocate a new sequence and run its whole prefill as one step, as the scheduler would."""
    seq = new_seq(token_ids)
    match = bm.can_allocate(seq)
    assert match is not None
    bm.allocate(seq, match)
    bm.release_copy_sources()  # the step ran: its copies are done
    run_step(bm, seq, seq.num_tokens - seq.num_cached_tokens)
    bm.index_written_tail(seq)  # as postprocess does after a prefill step
    return seq


def num_cached(bm: BlockManager, seq: Sequence) -> int:
    """Tokens of seq the cache would give it, or -1 if its blocks do not fit."""
    match = bm.can_allocate(seq)
    return -1 if match is None else match.num_cached_tokens


def run_step(bm: BlockManager, seq: Sequence, num_tokens: int) -> None:
    """Compute num_tokens more tokens of seq: the block-manager half of Scheduler.postprocess."""
    seq.num_scheduled_tokens = num_tokens
    bm.hash_blocks(seq)
    seq.num_cached_tokens += num_tokens
    seq.num_scheduled_tokens = 0


def decode_step(bm: BlockManager, seq: Sequence, token_id: int) -> None:
    """Append a sampled token, then compute it (may_append first, as the scheduler does)."""
    seq.append_token(token_id)
    assert bm.can_append(seq)
    bm.may_append(seq)
    run_step(bm, seq, 1)


def chain_hashes(token_ids: list[int]) -> list[int]:
    hashes, h = [], -1
    for i in range(len(token_ids) // BS):
        h = compute_block_hash(token_ids[i * BS:(i + 1) * BS], h)
        hashes.append(h)
    return hashes


def assert_consistent(bm: BlockManager) -> None:
    free = set(bm.free_block_ids)
    assert not free & bm.used_block_ids
    assert free | bm.used_block_ids == set(range(bm.num_blocks))
    for block in bm.blocks:
        assert (block.ref_count > 0) == (block.block_id in bm.used_block_ids)


# --- free queue and ref counts --------------------------------------------------------------

def test_allocate_takes_blocks_from_the_head_of_the_free_queue():
    bm = BlockManager(8, BS)
    seq = new_seq(list(range(10)))
    bm.allocate(seq, bm.can_allocate(seq))
    assert seq.block_table == [0, 1, 2]
    assert list(bm.free_block_ids) == [3, 4, 5, 6, 7]
    assert all(bm.blocks[b].ref_count == 1 for b in seq.block_table)
    assert_consistent(bm)


def test_deallocate_returns_blocks_to_the_tail_in_reverse_order():
    bm = BlockManager(8, BS)
    seq = new_seq(list(range(10)))
    bm.allocate(seq, bm.can_allocate(seq))
    bm.deallocate(seq)
    # Later blocks are overwritten first; the first block (likeliest shared prefix) stays longest.
    assert list(bm.free_block_ids) == [3, 4, 5, 6, 7, 2, 1, 0]
    assert seq.block_table == [] and seq.num_cached_tokens == 0
    assert all(block.ref_count == 0 for block in bm.blocks)
    assert_consistent(bm)


def test_sequences_with_a_shared_prefix_share_its_blocks_with_ref_counts():
    bm = BlockManager(8, BS)
    a = prefill(bm, list(range(9)))
    b = new_seq(list(range(9)))
    assert bm.can_allocate(b).block_ids == a.block_table[:2]
    bm.allocate(b, bm.can_allocate(b))
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]  # a partly filled last block is never shared
    assert [bm.blocks[i].ref_count for i in b.block_table] == [2, 2, 1]
    assert b.num_cached_tokens == 2 * BS
    assert_consistent(bm)


def test_a_shared_block_is_freed_only_when_its_last_sequence_releases_it():
    bm = BlockManager(8, BS)
    a = prefill(bm, list(range(9)))
    b = prefill(bm, list(range(9)))
    shared = a.block_table[:2]
    bm.deallocate(a)
    assert all(bm.blocks[i].ref_count == 1 and i in bm.used_block_ids for i in shared)
    assert not set(shared) & set(bm.free_block_ids)
    bm.deallocate(b)
    assert all(bm.blocks[i].ref_count == 0 for i in shared)
    assert set(shared) <= set(bm.free_block_ids)
    assert_consistent(bm)


# --- hash chain -----------------------------------------------------------------------------

def test_block_hash_is_xxhash64_of_the_prefix_hash_then_int64_tokens():
    tokens = [1, 2, 3, 70000]
    assert compute_block_hash(tokens) == xxhash.xxh64(array("q", tokens).tobytes()).intdigest()
    prefix = compute_block_hash([9, 9, 9, 9])
    expected = xxhash.xxh64(prefix.to_bytes(8, "little") + array("q", tokens).tobytes()).intdigest()
    assert compute_block_hash(tokens, prefix) == expected


def test_same_tokens_after_a_different_prefix_hash_differently_and_do_not_hit():
    bm = BlockManager(8, BS)
    a = prefill(bm, [1, 1, 1, 1, 5, 6, 7, 8, 0])
    b = new_seq([2, 2, 2, 2, 5, 6, 7, 8, 0])
    assert bm.blocks[a.block_table[1]].hash != compute_block_hash([5, 6, 7, 8])
    assert bm.blocks[a.block_table[1]].hash == compute_block_hash([5, 6, 7, 8], compute_block_hash([1, 1, 1, 1]))
    assert num_cached(bm, b) == 0  # block 1's tokens match, but its context does not


def test_a_hash_hit_with_different_token_ids_is_not_reused():
    bm = BlockManager(8, BS)
    a = prefill(bm, [1, 2, 3, 4, 0])
    other = [5, 6, 7, 8, 0]
    # Simulate an xxhash collision: other's first-block hash points at a's block.
    bm.hash_to_block_id[compute_block_hash(other[:BS])] = a.block_table[0]
    seq = new_seq(other)
    assert num_cached(bm, seq) == 0
    bm.allocate(seq, bm.can_allocate(seq))
    assert a.block_table[0] not in seq.block_table


def test_a_registered_block_whose_token_ids_differ_is_not_reused():
    bm = BlockManager(8, BS)
    a = prefill(bm, [1, 2, 3, 4, 0])
    bm.blocks[a.block_table[0]].token_ids[3] = 5  # same hash in the table, other content
    match = bm.can_allocate(new_seq([1, 2, 3, 4, 0]))
    # not shared by reference; the head its content does share ([1, 2, 3]) is copied (was: 0 tokens)
    assert match.block_ids == [] and match.copy_src == a.block_table[0] and match.num_cached_tokens == 3


# --- registration (hash_blocks) -------------------------------------------------------------

def test_hash_blocks_registers_only_full_blocks():
    bm = BlockManager(8, BS)
    seq = prefill(bm, list(range(10)))
    h0, h1 = chain_hashes(list(range(10)))
    assert [bm.blocks[i].hash for i in seq.block_table] == [h0, h1, -1]
    assert bm.blocks[seq.block_table[0]].token_ids == [0, 1, 2, 3]
    assert bm.hash_to_block_id == {h0: seq.block_table[0], h1: seq.block_table[1]}


def test_a_chunk_ending_mid_block_registers_that_block_only_when_a_later_chunk_fills_it():
    bm = BlockManager(8, BS)
    tokens = list(range(13))
    seq = new_seq(tokens)
    bm.allocate(seq, bm.can_allocate(seq))
    run_step(bm, seq, 6)  # fills block 0, half of block 1
    assert [bm.blocks[i].hash != -1 for i in seq.block_table] == [True, False, False, False]
    assert len(bm.hash_to_block_id) == 1
    run_step(bm, seq, 1)  # block 1 still not full
    assert bm.blocks[seq.block_table[1]].hash == -1
    run_step(bm, seq, 6)  # fills blocks 1 and 2, ends in block 3
    assert [bm.blocks[i].hash for i in seq.block_table] == chain_hashes(tokens) + [-1]


def test_decode_registers_a_block_exactly_when_its_last_token_is_computed():
    bm = BlockManager(8, BS)
    seq = prefill(bm, [1, 2, 3, 4, 5])
    last = seq.block_table[1]
    for token_id in (6, 7):
        decode_step(bm, seq, token_id)
        assert bm.blocks[last].hash == -1
    decode_step(bm, seq, 8)  # computes token 8, the 4th of block 1
    assert bm.blocks[last].hash == chain_hashes([1, 2, 3, 4, 5, 6, 7, 8])[1]
    assert bm.blocks[last].token_ids == [5, 6, 7, 8]
    assert bm.hash_to_block_id[bm.blocks[last].hash] == last


# --- lookup (can_allocate / allocate) -------------------------------------------------------

def test_an_in_use_hit_needs_no_free_block():
    bm = BlockManager(4, BS)
    prefill(bm, list(range(9)))  # holds 3 blocks, 1 free
    seq = new_seq(list(range(9)))  # 3 blocks: 2 in-use hits + 1 new
    assert num_cached(bm, seq) == 2 * BS
    bm.allocate(seq, bm.can_allocate(seq))
    assert bm.num_free_blocks == 0
    assert_consistent(bm)


def test_a_freed_hit_is_taken_back_out_of_the_free_queue_and_counts_as_a_free_block():
    bm = BlockManager(4, BS)
    a = prefill(bm, list(range(9)))
    old = a.block_table[:2]
    bm.deallocate(a)
    prefill(bm, [100])  # takes the head of the free queue (block 3), leaves 3 free
    seq = new_seq(list(range(9)))
    assert num_cached(bm, seq) == 2 * BS  # 2 freed hits + 1 new block = 3 free blocks
    bm.allocate(seq, bm.can_allocate(seq))
    assert seq.block_table[:2] == old
    assert all(bm.blocks[i].ref_count == 1 and i in bm.used_block_ids for i in old)
    assert not set(old) & set(bm.free_block_ids)
    assert_consistent(bm)


def test_can_allocate_refuses_when_freed_hits_plus_new_blocks_exceed_the_free_queue():
    bm = BlockManager(4, BS)
    a = prefill(bm, list(range(9)))
    bm.deallocate(a)
    prefill(bm, list(range(100, 105)))  # holds 2 blocks, 2 free
    assert bm.can_allocate(new_seq(list(range(9)))) is None  # 2 freed hits still need 2 + 1 free


def test_the_last_block_is_never_looked_up():
    bm = BlockManager(8, BS)
    a = prefill(bm, list(range(8)))  # both blocks registered
    seq = new_seq(list(range(8)))
    match = bm.can_allocate(seq)
    # Block 1 is never hit as a whole: its last token is recomputed to get logits for the next one.
    # Its first BS - 1 tokens are copied (the seed recomputed the whole block: num_cached_tokens BS).
    assert match.block_ids == a.block_table[:1] and match.copy_src == a.block_table[1]
    bm.allocate(seq, match)
    assert seq.num_cached_tokens == 2 * BS - 1


def test_hits_must_be_contiguous_from_the_first_block():
    bm = BlockManager(8, BS)
    a = prefill(bm, list(range(13)))
    bm.hash_to_block_id.pop(bm.blocks[a.block_table[1]].hash)  # block 1 no longer in the hash table
    match = bm.can_allocate(new_seq(list(range(13))))
    # Block 2 is not hit past the gap. Block 1's content is still indexed as a head, so it is copied
    # (was: num_cached_tokens BS).
    assert match.block_ids == a.block_table[:1] and match.copy_src == a.block_table[1]
    assert match.num_cached_tokens == 2 * BS


def test_a_freed_block_keeps_its_hash_and_can_still_hit():
    bm = BlockManager(8, BS)
    a = prefill(bm, list(range(9)))
    full_blocks = a.block_table[:2]
    hashes = [bm.blocks[i].hash for i in full_blocks]
    bm.deallocate(a)
    assert set(full_blocks) <= set(bm.free_block_ids)
    assert [bm.blocks[i].hash for i in full_blocks] == hashes
    assert [bm.hash_to_block_id[h] for h in hashes] == full_blocks
    assert num_cached(bm, new_seq(list(range(9)))) == 2 * BS


def test_a_freed_block_stops_hitting_once_it_is_overwritten():
    bm = BlockManager(6, BS)
    a = prefill(bm, list(range(9)))
    block0, block1 = a.block_table[:2]
    h0, h1 = chain_hashes(list(range(9)))
    bm.deallocate(a)  # free queue: 3 4 5 2 1 0
    other = prefill(bm, list(range(100, 117)))  # 5 blocks: overwrites 3 4 5 2 1, not 0
    assert block1 in other.block_table and block0 not in other.block_table
    assert h1 not in bm.hash_to_block_id and bm.hash_to_block_id[h0] == block0
    bm.deallocate(other)
    assert num_cached(bm, new_seq(list(range(9)))) == BS  # block 0 still hits, block 1 no longer
    other = prefill(bm, list(range(200, 221)))  # all 6 blocks: block 0 overwritten too
    bm.deallocate(other)
    assert h0 not in bm.hash_to_block_id
    assert num_cached(bm, new_seq(list(range(9)))) == 0


def test_overwriting_a_block_keeps_a_table_entry_that_points_at_a_newer_block():
    bm = BlockManager(6, BS)
    a, b = new_seq(list(range(9))), new_seq(list(range(9)))
    bm.allocate(a, bm.can_allocate(a))
    bm.allocate(b, bm.can_allocate(b))  # both miss: a's blocks are not registered yet
    run_step(bm, a, 9)
    run_step(bm, b, 9)  # same content: the table now points at b's blocks
    h0 = chain_hashes(list(range(9)))[0]
    assert bm.hash_to_block_id[h0] == b.block_table[0]
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    bm.deallocate(a)
    bm.deallocate(b)  # free queue: a2 a1 a0 b2 b1 b0
    prefill(bm, list(range(100, 112)))  # overwrites a's three blocks only
    assert bm.hash_to_block_id[h0] == b_blocks[0]
    seq = new_seq(list(range(9)))
    assert num_cached(bm, seq) == 2 * BS
    bm.allocate(seq, bm.can_allocate(seq))
    assert seq.block_table[:2] == b_blocks[:2] and not set(seq.block_table) & set(a_blocks[:2])


def test_a_preempted_sequence_rehits_its_own_freed_blocks():
    bm = BlockManager(8, BS)
    seq = prefill(bm, list(range(6)))
    for token_id in (6, 7, 8):  # computes up to token 8: blocks 0 and 1 full
        decode_step(bm, seq, token_id)
    seq.append_token(9)
    full_blocks = seq.block_table[:2]
    bm.deallocate(seq)  # preemption by recompute
    assert seq.num_cached_tokens == 0 and not seq.block_table
    match = bm.can_allocate(seq)
    assert match.block_ids == full_blocks
    bm.allocate(seq, match)
    assert seq.block_table[:2] == full_blocks
    # only token 9 is recomputed: token 8's K/V is copied from its freed last block (was: 8 and 9)
    assert seq.num_cached_tokens == 9


def test_taking_back_a_freed_block_keeps_the_fifo_order_of_the_rest():
    bm = BlockManager(8, BS)
    a = prefill(bm, list(range(9)))
    bm.deallocate(a)  # free queue: 3 4 5 6 7 2 1 0
    seq = new_seq(list(range(9)))
    bm.allocate(seq, bm.can_allocate(seq))  # takes back 0 and 1, then 3 from the head
    assert seq.block_table == [0, 1, 3]
    assert list(bm.free_block_ids) == [4, 5, 6, 7, 2]
    assert_consistent(bm)


def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = prefill(bm, list(range(9)))
    assert bm.hash_to_block_id == {}
    assert all(bm.blocks[i].hash == -1 for i in a.block_table)
    seq = new_seq(list(range(9)))
    assert num_cached(bm, seq) == 0
    bm.allocate(seq, bm.can_allocate(seq))
    assert seq.num_cached_tokens == 0 and not set(seq.block_table) & set(a.block_table)


# --- decode growth (can_append / may_append) ------------------------------------------------

def grown_sequence(num_tokens: int, num_spare_blocks: int) -> tuple[BlockManager, Sequence]:
    """A sequence whose first num_tokens - 1 tokens are allocated, with one more token appended."""
    bm = BlockManager((num_tokens - 1 + BS - 1) // BS + num_spare_blocks, BS)
    seq = new_seq(list(range(num_tokens - 1)))
    bm.allocate(seq, bm.can_allocate(seq))
    seq.append_token(99)
    return bm, seq


@pytest.mark.parametrize("num_tokens", range(5, 14))
def test_can_append_needs_a_free_block_exactly_when_len_mod_block_size_is_1(num_tokens):
    bm, seq = grown_sequence(num_tokens, num_spare_blocks=0)
    assert bm.can_append(seq) == (num_tokens % BS != 1)


@pytest.mark.parametrize("num_tokens", range(5, 14))
def test_may_append_adds_a_block_exactly_when_len_mod_block_size_is_1(num_tokens):
    bm, seq = grown_sequence(num_tokens, num_spare_blocks=1)
    before = len(seq.block_table)
    bm.may_append(seq)
    assert len(seq.block_table) == before + (num_tokens % BS == 1) == seq.num_blocks


# --- the seed's worked examples at block size 256 -------------------------------------------

def _prefilled_at_256(monkeypatch, token_ids: list[int]) -> BlockManager:
    monkeypatch.setitem(globals(), "SEQ_BLOCK_SIZE", 256)
    bm = BlockManager(16, 256)
    prefill(bm, token_ids)
    return bm


def test_a_600_token_shared_prefix_reuses_600_tokens_at_block_size_256(monkeypatch):
    shared = list(range(1000, 1600))
    bm = _prefilled_at_256(monkeypatch, shared + [1] * 40)
    seq = new_seq(shared + [2] * 40)
    bm.allocate(seq, bm.can_allocate(seq))
    # the seed reused 512 (whole blocks); the 88 shared tokens of the third block are now copied
    assert seq.num_cached_tokens == 600


def test_an_exact_512_token_repeat_reuses_511_tokens_at_block_size_256(monkeypatch):
    prompt = list(range(1000, 1512))
    bm = _prefilled_at_256(monkeypatch, prompt)
    seq = new_seq(prompt)
    bm.allocate(seq, bm.can_allocate(seq))
    # the seed reused 256 and recomputed the whole last block; now only the last token, for its logits
    assert seq.num_cached_tokens == 511


# --- exact reuse: block heads copied on top of the seed's whole blocks ----------------------

def test_a_prefix_ending_mid_block_copies_the_shared_head_into_a_fresh_block():
    bm = BlockManager(8, BS)
    a = prefill(bm, list(range(10)))
    seq = new_seq(list(range(6)) + [50, 51])
    bm.allocate(seq, bm.can_allocate(seq))
    assert seq.block_table[0] == a.block_table[0]  # whole blocks still shared by reference
    assert seq.block_table[1] not in a.block_table  # the partly matching block is the request's own
    assert bm.block_copies == [(a.block_table[1], seq.block_table[1], 2)]  # tokens 4 and 5
    assert seq.num_cached_tokens == 6
    assert bm.blocks[a.block_table[1]].ref_count == 2  # a's, and the pin until the copy ran
    bm.release_copy_sources()
    assert bm.block_copies == [] and bm.blocks[a.block_table[1]].ref_count == 1
    assert_consistent(bm)


def test_a_freed_copy_source_is_pinned_so_the_same_step_cannot_hand_it_out():
    bm = BlockManager(3, BS)
    a = prefill(bm, list(range(6)))  # block 0 full, block 1 holds tokens 4 and 5
    bm.deallocate(a)  # free queue: 2 1 0
    seq = new_seq(list(range(5)) + [77])
    bm.allocate(seq, bm.can_allocate(seq))  # block 0 taken back, block 1 pinned, block 2 fresh
    assert seq.block_table == [0, 2] and bm.block_copies == [(1, 2, 1)]
    assert 1 not in bm.free_block_ids and bm.blocks[1].ref_count == 1
    assert bm.can_allocate(new_seq([300])) is None  # nothing free: block 1 cannot be overwritten now
    bm.release_copy_sources()
    assert list(bm.free_block_ids) == [1] and bm.blocks[1].ref_count == 0
    assert bm.blocks[1].token_ids == [4, 5]  # still cached: it can serve the next request too
    assert_consistent(bm)


def test_a_copy_whose_freed_source_does_not_fit_is_dropped_instead_of_waited_for():
    bm = BlockManager(2, BS)
    a = prefill(bm, list(range(6)))
    bm.deallocate(a)  # free queue: 1 0
    seq = new_seq(list(range(5)) + [77])  # needs both blocks: no room to pin block 1 as well
    match = bm.can_allocate(seq)
    assert match.copy_src == -1 and match.num_cached_tokens == BS
    bm.allocate(seq, match)
    assert bm.block_copies == [] and seq.block_table == [0, 1]


def test_overwriting_a_block_drops_its_head_entry():
    bm = BlockManager(3, BS)
    a = prefill(bm, list(range(6)))
    bm.deallocate(a)
    assert len(bm.heads) == 2  # block 0 whole, block 1's written head
    prefill(bm, list(range(100, 112)))  # takes all three blocks
    assert len(bm.heads) == 3 and bm.heads.longest_match(-1, [0, 1, 2, 3]) == (-1, 0)
    assert all(bm.blocks[i].parent_hash is not None for i in range(3))


def test_a_finished_sequences_generated_tokens_are_reused_too():
    bm = BlockManager(8, BS)
    a = prefill(bm, [1, 2, 3, 4, 5])
    for token_id in (6, 7):
        decode_step(bm, a, token_id)
    a.append_token(8)  # sampled, its K/V never computed
    bm.deallocate(a)
    seq = new_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.allocate(seq, bm.can_allocate(seq))
    assert seq.num_cached_tokens == 7  # tokens 1-7 were written; 8 was only sampled


def test_prefix_cache_counters_count_prompt_tokens_and_hits():
    bm = BlockManager(8, BS)
    prefill(bm, list(range(10)))
    seq = new_seq(list(range(7)) + [99])
    bm.allocate(seq, bm.can_allocate(seq))
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (10 + 8, 0 + 7)
    assert bm.usage == 4 / 8  # a's 3 (its block 1 also pinned as the source) and seq's fresh block 1


def test_a_fork_shares_whole_prompt_blocks_and_copies_the_head_of_the_last():
    bm = BlockManager(8, BS)
    parent = prefill(bm, list(range(10)))  # blocks 0, 1 full; block 2 holds tokens 8, 9
    child = new_seq(list(range(10)))
    bm.fork(child, parent)
    assert child.block_table[:2] == parent.block_table[:2] and child.block_table[2] not in parent.block_table
    # token 9 is recomputed for the child's own logits: only token 8's row is copied, the source pinned
    assert bm.block_copies == [(parent.block_table[2], child.block_table[2], 1)]
    assert child.num_cached_tokens == 9 and bm.blocks[parent.block_table[2]].ref_count == 2
    bm.release_copy_sources()
    assert bm.blocks[parent.block_table[2]].ref_count == 1
    assert_consistent(bm)
