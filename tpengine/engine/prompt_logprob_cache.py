"""Prompt logprobs kept beside the prefix cache, by the chain hash of the whole prompt block they score (each
position's entry depends only on the tokens up to it, all of which that hash covers). A request that shares a
prefix with one scored before (lm-eval's multiple choice: one context, several continuations) reuses the K/V of
the blocks whose logprobs are kept and computes only the rest. Bounded: the least recently used block's entries
go first. Plain bookkeeping, no tensors."""
from collections import OrderedDict


class PromptLogprobCache:
    def __init__(self, max_blocks: int):
        self.max_blocks = max_blocks
        self.blocks: OrderedDict[int, list] = OrderedDict()  # chain hash -> its positions' entries
        self.num_hits = 0       # blocks whose kept entries stood for computing them
        # positions kept (the memory it holds: each a token's logprob and its top alternatives), reported by /metrics
        self.num_entries = 0

    def kept_run(self, hashes: list[int]) -> int:
        """How many of a prompt's first whole blocks (by chain hash) have kept entries. It may take their K/V from
        the prefix cache but for their last token, which runs again so that its row scores the position after."""
        run = 0
        for h in hashes:
            if h not in self.blocks:
                break
            run += 1
        return run

    def entries(self, hashes: list[int], num_positions: int) -> list:
        """The kept entries of a prompt's first num_positions positions (its first blocks', by chain hash)."""
        found = []
        for h in hashes:
            if len(found) >= num_positions:
                break
            self.blocks.move_to_end(h)
            found += self.blocks[h]
            self.num_hits += 1
        return found[:num_positions]

    def put(self, h: int, entries: list) -> None:
        if self.max_blocks <= 0:
            return
        self.num_entries += len(entries) - len(self.blocks.get(h, ()))
        self.blocks[h] = entries
        self.blocks.move_to_end(h)
        while len(self.blocks) > self.max_blocks:
            self.num_entries -= len(self.blocks.popitem(last=False)[1])
