"""The paged-KV-cache ledger: which physical blocks each sequence owns, and the prefix cache.

Plain bookkeeping: no tensors here. Rules follow the seed design (nano-vllm's BlockManager),
with one change: the free queue is an OrderedDict, so taking back a freed block on a prefix
hit is O(1) while the queue keeps its FIFO order.
"""
from array import array
from collections import OrderedDict

import xxhash

from tpengine.engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1           # -1: not full, or not registered in the prefix cache
        self.token_ids: list[int] = []

    def update(self, hash: int, token_ids: list[int]) -> None:
        self.hash = hash
        self.token_ids = token_ids

    def reset(self) -> None:
        self.ref_count = 1
        self.hash = -1
        self.token_ids = []


def compute_block_hash(token_ids: list[int], prefix: int = -1) -> int:
    """xxhash64 of the previous block's hash and this block's tokens: a hash chain."""
    h = xxhash.xxh64()
    if prefix != -1:
        h.update(prefix.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())  # same bytes as np.int64 array, cheaper for short lists
    return h.intdigest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        # FIFO: take from the head, return to the tail; values unused. O(1) removal by id.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.used_block_ids: set[int] = set()

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def _allocate_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0
        # The block is about to be overwritten: drop its prefix-cache entry, unless the
        # table already points at a newer block with the same content.
        if block.hash != -1 and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
        block.reset()
        self.used_block_ids.add(block_id)
        return block_id

    def _deallocate_block(self, block_id: int) -> None:
        # Hash and token ids stay: the block can still be hit until it is overwritten.
        assert self.blocks[block_id].ref_count == 0
        self.used_block_ids.remove(block_id)
        self.free_block_ids[block_id] = None

    def _cached_block_ids(self, seq: Sequence):
        """Yield (block_id, hash) for the contiguous run of prefix-cache hits of seq.

        The last block is never looked up: prefill must compute at least one token to get
        the logits that sample the next one.
        """
        if not self.enable_prefix_caching:
            return
        h = -1
        for i in range(seq.num_blocks - 1):
            token_ids = seq.block(i)
            h = compute_block_hash(token_ids, h)
            block_id = self.hash_to_block_id.get(h, -1)
            # Compare tokens too, so an xxhash collision can never reuse the wrong block.
            if block_id == -1 or self.blocks[block_id].token_ids != token_ids:
                return  # hits must be contiguous: later K/V depends on this block's
            yield block_id

    def can_allocate(self, seq: Sequence) -> int:
        """Number of prefix-cache blocks seq would hit, or -1 if free blocks can't cover the rest."""
        num_cached_blocks = 0
        num_new_blocks = seq.num_blocks
        for block_id in self._cached_block_ids(seq):
            num_cached_blocks += 1
            # An in-use hit is shared and costs no free block; a freed hit is taken back
            # out of the free queue, so it still counts as one.
            if block_id in self.used_block_ids:
                num_new_blocks -= 1
        if len(self.free_block_ids) < num_new_blocks:
            return -1
        return num_cached_blocks

    def allocate(self, seq: Sequence, num_cached_blocks: int) -> None:
        assert not seq.block_table
        cached = self._cached_block_ids(seq)
        for _ in range(num_cached_blocks):
            block_id = next(cached)
            block = self.blocks[block_id]
            if block_id in self.used_block_ids:
                block.ref_count += 1
            else:
                block.ref_count = 1
                del self.free_block_ids[block_id]
                self.used_block_ids.add(block_id)
            seq.block_table.append(block_id)
        for _ in range(num_cached_blocks, seq.num_blocks):
            seq.block_table.append(self._allocate_block())
        seq.num_cached_tokens = num_cached_blocks * self.block_size

    def deallocate(self, seq: Sequence) -> None:
        # Reverse order: a sequence's later blocks are overwritten first, its early blocks
        # (the likeliest shared prefix) stay in the cache longest.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._deallocate_block(block_id)
        seq.num_cached_tokens = 0
        seq.block_table.clear()

    def fork(self, child: Sequence, parent: Sequence) -> None:
        """Give child (another completion of parent's prompt) the prompt's K/V without computing it again:
        the full blocks before the last prompt token are shared; the block holding that token is copied
        into a new one (child.copy_source_block), where the child recomputes the token for its own logits."""
        assert not child.block_table and child.num_tokens == parent.num_prompt_tokens and self.free_block_ids
        last = (parent.num_prompt_tokens - 1) // self.block_size
        for block_id in parent.block_table[:last]:
            self.blocks[block_id].ref_count += 1
            child.block_table.append(block_id)
        child.block_table.append(self._allocate_block())
        child.copy_source_block = parent.block_table[last]
        child.num_cached_tokens = parent.num_prompt_tokens - 1

    def can_append(self, seq: Sequence) -> bool:
        # A new block is needed only when the token to compute is the first of a block.
        return len(self.free_block_ids) >= (seq.num_tokens % self.block_size == 1)

    def may_append(self, seq: Sequence) -> None:
        if seq.num_tokens % self.block_size == 1:
            seq.block_table.append(self._allocate_block())

    def hash_blocks(self, seq: Sequence) -> None:
        """Register the blocks that the current step filled (call before num_cached_tokens moves)."""
        if not self.enable_prefix_caching:
            return
        start = seq.num_cached_tokens // self.block_size
        end = (seq.num_cached_tokens + seq.num_scheduled_tokens) // self.block_size
        if start == end:
            return
        h = self.blocks[seq.block_table[start - 1]].hash if start > 0 else -1
        for i in range(start, end):
            block = self.blocks[seq.block_table[i]]
            token_ids = seq.block(i)
            h = compute_block_hash(token_ids, h)
            block.update(h, token_ids)
            self.hash_to_block_id[h] = block.block_id  # the newest block with this content wins
