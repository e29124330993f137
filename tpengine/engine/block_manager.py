"""The paged-KV-cache ledger: which physical blocks each sequence owns, and the prefix cache.

Plain bookkeeping: no tensors here. Rules follow the seed design (nano-vllm's BlockManager):
full blocks are found through the xxhash chain and shared by reference, the last block is never
looked up as a whole, freed blocks keep their hash until overwritten. One change: the free queue
is an OrderedDict, so taking back a freed block on a prefix hit is O(1) while the queue keeps its
FIFO order.

On top of the seed, reuse is exact to the token: where the chain of whole-block hits ends, the
cached block that shares the longest head with the request's next block (found in a HeadIndex) has
that head copied into the request's own fresh block, so only the tokens after it are computed.

LongRoPE: a block's K/V depend on the factor set its sequence was rotated with, so a long sequence's chain
starts from its own root (chain_root): its blocks never serve a short sequence, nor a short one's a long one.

Where every layer attends within a sliding window, a sequence gives back the blocks that no later token
can see as it grows (release_out_of_window); its table keeps -1 in their place. They keep their hash like
any freed block, so a later request can still hit them until they are overwritten.
"""
from array import array
from collections import OrderedDict

import xxhash

from tpengine.engine.prefix_index import HeadIndex
from tpengine.engine.sequence import Sequence
from tpengine.paging import blocks_for, opens_block


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "parent_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1           # -1: not full, or not registered in the prefix cache
        self.token_ids: list[int] = []  # the tokens whose K/V the block holds (all of them once full)
        self.parent_hash: int | None = None  # chain hash before it while in the head index, else None

    def update(self, hash: int, token_ids: list[int]) -> None:
        self.hash = hash
        self.token_ids = token_ids

    def reset(self) -> None:
        self.ref_count = 1
        self.hash = -1
        self.token_ids = []
        self.parent_hash = None


def compute_block_hash(token_ids: list[int], prefix: int = -1) -> int:
    """xxhash64 of the previous block's hash and this block's tokens: a hash chain."""
    h = xxhash.xxh64()
    if prefix != -1:
        h.update(prefix.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())  # same bytes as np.int64 array, cheaper for short lists
    return h.intdigest()


# the chain hash "before" a long-RoPE sequence's first block (a short one's is -1, as every other model's)
LONG_ROPE_ROOT = compute_block_hash([0x4C4F4E47524F5045])


# marks a LoRA adapter's chain root: the hash of the mark and the adapter's id under the rope set's root
LORA_ROOT_MARK = 0x4C4F5241


def chain_root(seq: Sequence) -> int:
    """The chain hash before seq's first block: its tokens' K/V are found only under the same root (the same
    rope set and LoRA adapter)."""
    root = LONG_ROPE_ROOT if seq.long_rope else -1
    if seq.lora is not None:
        root = compute_block_hash([LORA_ROOT_MARK, seq.lora.lora_int_id], root)
    return root


class PrefixMatch:
    """What a sequence would reuse: whole blocks shared by reference, then the head of copy_src."""
    __slots__ = ("block_ids", "copy_src", "num_copied_tokens", "num_cached_tokens", "num_new_blocks", "num_blocks")

    def __init__(self, block_ids: list[int], copy_src: int, num_copied_tokens: int, num_cached_tokens: int,
                 num_new_blocks: int, num_blocks: int):
        self.block_ids = block_ids                # -1: a hit behind every layer's window, not taken
        self.copy_src = copy_src                  # -1: nothing copied
        self.num_copied_tokens = num_copied_tokens
        self.num_cached_tokens = num_cached_tokens
        self.num_new_blocks = num_new_blocks      # free blocks the allocation takes
        self.num_blocks = num_blocks              # the sequence's table length after it


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None, first_block_id: int = 0):
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        # every layer's window (the longest, where a draft model has its own): blocks behind it are released
        self.sliding_window = sliding_window
        self.enable_prefix_caching = enable_prefix_caching
        # False: the seed's cache alone, reuse rounded down to whole blocks (kept for comparison)
        # ids first_block_id onwards: a pipeline's virtual engines each own a range of one cache
        self.blocks = [None] * first_block_id + [Block(i) for i in range(first_block_id, first_block_id + num_blocks)]
        self._num_blocks = num_blocks
        self.hash_to_block_id: dict[int, int] = {}
        self.heads = HeadIndex()  # every block with written K/V, under the chain hash before it
        # FIFO: take from the head, return to the tail; values unused. O(1) removal by id.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(
            range(first_block_id, first_block_id + num_blocks))
        self.used_block_ids: set[int] = set()
        # (src, dst, num_tokens): K/V rows to copy on every rank before this step's forward. Each
        # src is pinned (one extra reference) until release_copy_sources, so that no allocation of
        # the same step can hand it out and overwrite it before the copy ran.
        self.block_copies: list[tuple[int, int, int]] = []
        self.prefix_cache_queries = 0  # prompt tokens looked up, and how many of them hit (for metrics)
        self.prefix_cache_hits = 0

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences (freed blocks still cached count as free)."""
        return len(self.used_block_ids) / self._num_blocks

    # --- blocks ---------------------------------------------------------------------------------

    def _allocate_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0
        # The block is about to be overwritten: drop its prefix-cache entries, unless the hash
        # table already points at a newer block with the same content.
        if block.hash != -1 and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
        if block.parent_hash is not None:
            self.heads.remove(block.parent_hash, block.token_ids, block_id)
        block.reset()
        self.used_block_ids.add(block_id)
        return block_id

    def _deallocate_block(self, block_id: int) -> None:
        # Hash, token ids and head-index entry stay: the block can still be hit until it is overwritten.
        assert self.blocks[block_id].ref_count == 0
        self.used_block_ids.remove(block_id)
        self.free_block_ids[block_id] = None

    def _take(self, block_id: int) -> None:
        """One more reference to a cached block: shared if in use, else taken back out of the free queue."""
        block = self.blocks[block_id]
        if block_id in self.used_block_ids:
            block.ref_count += 1
        else:
            block.ref_count = 1
            del self.free_block_ids[block_id]
            self.used_block_ids.add(block_id)

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self._deallocate_block(block_id)

    # --- lookup ---------------------------------------------------------------------------------

    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """Chain hashes of seq's first num_blocks (full) blocks, memoized on seq: tokens are only appended."""
        hashes = seq.block_hashes
        h = hashes[-1] if hashes else chain_root(seq)
        for i in range(len(hashes), num_blocks):
            h = compute_block_hash(seq.block(i), h)
            hashes.append(h)
        return hashes

    def num_cached_blocks(self, seq: Sequence) -> int:
        """Whole blocks of seq the hash table holds now, by hash alone: a cheap score for admission."""
        if not self.enable_prefix_caching:
            return 0
        if self.sliding_window is not None:  # blocks behind the window need not be cached
            hashes = self.block_hashes(seq, seq.num_blocks - 1)[:seq.num_blocks - 1]
            return self._longest_seen_run([self.hash_to_block_id.get(h, -1) for h in hashes])
        hash_to_block_id = self.hash_to_block_id
        n = 0
        for h in self.block_hashes(seq, seq.num_blocks - 1)[:seq.num_blocks - 1]:
            if h not in hash_to_block_id:
                break
            n += 1
        return n

    def num_unseen_blocks(self, num_cached_tokens: int) -> int:
        """Blocks that no token computed from position num_cached_tokens on can see (every layer slides).

        That token sees the keys after num_cached_tokens - window; one position of slack keeps what a fork's
        child sees when it recomputes its parent's last prompt token.
        """
        return max(0, num_cached_tokens - self.sliding_window) // self.block_size

    def match(self, seq: Sequence, token_budget: int | None = None) -> PrefixMatch:
        """The longest prefix of seq the cache holds, leaving at least its last token to compute.

        Where every layer slides, a hit behind the window is -1 in block_ids (not taken: no token computed
        reads it), and the allocation covers only the first token_budget tokens after the hit (the first
        chunk: later chunks grow the table)."""
        block_ids: list[int] = []
        copy_src, num_copied = -1, 0
        if self.enable_prefix_caching and seq.reuse_limit != 0:
            block_size = self.block_size
            # The last block is never looked up as a whole: prefill must compute at least one token
            # to get the logits that sample the next one.
            limit = seq.reuse_limit  # tokens: a scored prompt's kept logprobs, less the row that scores the next
            num_full = seq.num_blocks - 1 if limit is None else min(seq.num_blocks - 1, limit // block_size)
            hashes = self.block_hashes(seq, num_full)[:num_full]
            if self.sliding_window is None:
                for i, h in enumerate(hashes):
                    block_id = self._cached_block(seq, i, h)
                    if block_id == -1:
                        break  # hits must be contiguous: later K/V depends on this block's
                    block_ids.append(block_id)
            else:
                block_ids = self._match_in_window(seq, hashes)
            parent = hashes[len(block_ids) - 1] if block_ids else chain_root(seq)
            start = len(block_ids) * block_size
            end = min(start + block_size, seq.num_tokens - 1)
            head = seq.cache_keys(start, end if limit is None else min(end, limit))
            if head:
                copy_src, num_copied = self.heads.longest_match(parent, head)
        num_cached_tokens = len(block_ids) * self.block_size + num_copied
        num_blocks = seq.num_blocks
        if self.sliding_window is not None:
            # whole blocks only: can_allocate may drop the copied head
            for i in range(min(self.num_unseen_blocks(len(block_ids) * self.block_size), len(block_ids))):
                block_ids[i] = -1
            if token_budget is not None:
                num_blocks = blocks_for(min(seq.num_tokens, num_cached_tokens + token_budget), self.block_size)
        used = self.used_block_ids
        num_new_blocks = num_blocks - sum(1 for b in block_ids if b == -1 or b in used)
        if copy_src != -1 and copy_src not in used:
            num_new_blocks += 1  # pinning a freed source takes it out of the free queue for the step
        return PrefixMatch(block_ids, copy_src, num_copied, num_cached_tokens, num_new_blocks, num_blocks)

    def _cached_block(self, seq: Sequence, i: int, h: int) -> int:
        """The cached block holding seq's block i (chain hash h), or -1."""
        block_id = self.hash_to_block_id.get(h, -1)
        # Compare tokens too, so an xxhash collision can never reuse the wrong block.
        if block_id == -1 or self.blocks[block_id].token_ids != seq.block(i):
            return -1
        return block_id

    def _match_in_window(self, seq: Sequence, hashes: list[int]) -> list[int]:
        """Where every layer slides, the longest run of whole blocks whose K/V the next token sees is cached:
        a block behind that token's window may have been overwritten (its hash still chains the rest), so
        the hit is the longest k whose blocks from num_unseen_blocks(k tokens) to k are all cached; -1 marks
        one that is not."""
        found = [self._cached_block(seq, i, h) for i, h in enumerate(hashes)]
        return found[:self._longest_seen_run(found)]

    def _longest_seen_run(self, found: list[int]) -> int:
        """The longest k such that found[num_unseen_blocks(k tokens):k] holds no -1 (an uncached block)."""
        missing_before = [-1] * (len(found) + 1)  # missing_before[k]: the last uncached block before k
        for i, block_id in enumerate(found):
            missing_before[i + 1] = i if block_id == -1 else missing_before[i]
        k = len(found)
        while k and missing_before[k] >= self.num_unseen_blocks(k * self.block_size):
            k -= 1
        return k

    def can_allocate(self, seq: Sequence, token_budget: int | None = None) -> PrefixMatch | None:
        """What seq would reuse from the prefix cache, or None if free blocks can't cover the rest (where every
        layer slides, the rest up to token_budget tokens: a prompt's later chunks grow its table)."""
        match = self.match(seq, token_budget)
        # An in-use hit is shared and costs no free block; a freed hit is taken back out of the
        # free queue, so it still counts as one.
        num_free = len(self.free_block_ids)
        if num_free < match.num_new_blocks and match.copy_src != -1 and match.copy_src not in self.used_block_ids:
            # pinning the freed source is what does not fit: compute its head instead of waiting
            match = PrefixMatch(match.block_ids, -1, 0, len(match.block_ids) * self.block_size,
                                match.num_new_blocks - 1, match.num_blocks)
        return match if num_free >= match.num_new_blocks else None

    def allocate(self, seq: Sequence, match: PrefixMatch) -> None:
        assert not seq.block_table
        for block_id in match.block_ids:
            if block_id != -1:
                self._take(block_id)
            else:
                seq.num_released_blocks += 1
            seq.block_table.append(block_id)
        if match.copy_src != -1:
            self._take(match.copy_src)  # pinned before any fresh block is taken below
        for _ in range(len(match.block_ids), match.num_blocks):
            seq.block_table.append(self._allocate_block())
        if match.copy_src != -1:
            self.block_copies.append((match.copy_src, seq.block_table[len(match.block_ids)],
                                      match.num_copied_tokens))
        seq.num_cached_tokens = match.num_cached_tokens
        self.prefix_cache_queries += seq.num_tokens
        self.prefix_cache_hits += match.num_cached_tokens

    def release_copy_sources(self) -> None:
        """The step's copies ran (or the step is gone): unpin their sources."""
        for src, _, _ in self.block_copies:
            self._release(src)
        self.block_copies.clear()

    # --- release and growth ---------------------------------------------------------------------

    def deallocate(self, seq: Sequence) -> None:
        self.index_written_tail(seq)  # its partly filled last block stays reusable while unwritten
        # Reverse order: a sequence's later blocks are overwritten first, its early blocks
        # (the likeliest shared prefix) stay in the cache longest.
        for block_id in reversed(seq.block_table):
            if block_id != -1:
                self._release(block_id)
        seq.num_cached_tokens = seq.num_draft_cached_tokens = 0
        seq.num_released_blocks = 0
        seq.block_table.clear()

    def release_out_of_window(self, seq: Sequence) -> None:
        """Give back seq's blocks that no token it computes from now on can see (every layer slides)."""
        num_unseen = self.num_unseen_blocks(seq.num_cached_tokens)
        table = seq.block_table
        for i in range(seq.num_released_blocks, min(num_unseen, len(table))):
            self._release(table[i])
            table[i] = -1
        seq.num_released_blocks = max(seq.num_released_blocks, min(num_unseen, len(table)))

    def can_fork(self, parent: Sequence) -> bool:
        """Whether a child of parent's prompt would find every block it sees in parent's table: a parent
        that ran past its prompt may have released blocks the child's recomputed last prompt token sees."""
        if self.sliding_window is None:
            return True
        return parent.num_released_blocks <= self.num_unseen_blocks(parent.num_prompt_tokens - 1)

    def fork(self, child: Sequence, parent: Sequence) -> None:
        """Give child (another completion of parent's prompt) the prompt's K/V without computing it again:
        the full blocks before the last prompt token are shared; the head of the block holding that
        token is copied into a new one (block_copies), where the child recomputes the token for its own
        logits. Works with the prefix cache off too."""
        assert not child.block_table and child.num_tokens == parent.num_prompt_tokens and self.free_block_ids
        num_cached_tokens = parent.num_prompt_tokens - 1
        last = num_cached_tokens // self.block_size
        for block_id in parent.block_table[:last]:
            if block_id != -1:  # released by the parent: out of the child's window too
                self.blocks[block_id].ref_count += 1
            child.block_table.append(block_id)
        child.num_released_blocks = parent.num_released_blocks
        child.block_table.append(self._allocate_block())
        num_copied = num_cached_tokens - last * self.block_size
        if num_copied:
            self._take(parent.block_table[last])  # pinned like any copy source (parent holds it too)
            self.block_copies.append((parent.block_table[last], child.block_table[-1], num_copied))
        child.num_cached_tokens = num_cached_tokens

    def can_append(self, seq: Sequence) -> bool:
        # A new block is needed only when the token to compute opens one (True counts as 1 free block).
        return len(self.free_block_ids) >= opens_block(seq.num_tokens, self.block_size)

    def may_append(self, seq: Sequence) -> int:
        """Give seq the block its next token opens, if it opens one; returns the block's id, or -1."""
        if not opens_block(seq.num_tokens, self.block_size):
            return -1
        block_id = self._allocate_block()
        seq.block_table.append(block_id)
        return block_id

    def grow(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Give seq the blocks its slots up to num_tokens need (a verify row's draft tokens: they get slots
        before they are tokens of seq); returns the new blocks' ids. The caller checked they are free."""
        new_block_ids = [self._allocate_block() for _ in range(blocks_for(num_tokens, self.block_size)
                                                                  - len(seq.block_table))]
        seq.block_table.extend(new_block_ids)
        return new_block_ids

    def shrink(self, seq: Sequence, num_blocks: int) -> None:
        """Give back seq's blocks after its first num_blocks: those that hold only rejected draft tokens'
        slots. They were never hashed (only accepted tokens enter the chain), so they go back as fresh."""
        assert num_blocks <= len(seq.block_table)
        while len(seq.block_table) > num_blocks:
            block_id = seq.block_table.pop()
            assert self.blocks[block_id].hash == -1 and self.blocks[block_id].ref_count == 1
            self._release(block_id)

    # --- registration ---------------------------------------------------------------------------

    def _index_head(self, block: Block, parent_hash: int, token_ids: list[int]) -> None:
        if block.parent_hash is not None:
            self.heads.remove(block.parent_hash, block.token_ids, block.block_id)
        block.parent_hash = parent_hash
        block.token_ids = token_ids
        self.heads.add(parent_hash, token_ids, block.block_id)

    def hash_blocks(self, seq: Sequence) -> None:
        """Register the blocks that the current step filled (call before num_cached_tokens moves)."""
        if not self.enable_prefix_caching:
            return
        start = seq.num_cached_tokens // self.block_size
        end = (seq.num_cached_tokens + seq.num_scheduled_tokens) // self.block_size
        if start == end:
            return
        hashes = self.block_hashes(seq, end)
        h = hashes[start - 1] if start > 0 else chain_root(seq)
        for i in range(start, end):
            block = self.blocks[seq.block_table[i]]
            token_ids = seq.block(i)
            self._index_head(block, h, token_ids)
            h = hashes[i]
            block.update(h, token_ids)
            self.hash_to_block_id[h] = block.block_id  # the newest block with this content wins

    def index_written_tail(self, seq: Sequence) -> None:
        """Index the written head of seq's partly filled last block, so a request sharing only part
        of a block can copy it (rows only ever get appended to it while seq holds it)."""
        num_written = seq.num_cached_tokens % self.block_size
        if not self.enable_prefix_caching or num_written == 0:
            return
        i = seq.num_cached_tokens // self.block_size
        block = self.blocks[seq.block_table[i]]
        if any(dst == block.block_id for _, dst, _ in self.block_copies):
            return  # its step never completed (copies are released once it did): the head may be unwritten
        if block.parent_hash is not None and len(block.token_ids) == num_written:
            return  # indexed already, as written now
        if i == 0:
            parent = chain_root(seq)
        else:
            parent = self.blocks[seq.block_table[i - 1]].hash if seq.block_table[i - 1] != -1 else -1
            if parent == -1:
                return  # its context is not in the hash chain: nothing could find it
        self._index_head(block, parent, seq.cache_keys(i * self.block_size, seq.num_cached_tokens))
