"""The prefix cache's index of block heads: what lets a request reuse cached K/V to the token.

The seed's xxhash chain finds whole blocks. This index finds, for one position in that chain, the
cached blocks whose written tokens continue it, and the one that shares the longest head with a
query. Plain bookkeeping: no tensors here.
"""
from bisect import bisect_left, insort


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the common head of two token lists (binary search over slice compares, done in C)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n - 1  # a[:lo] == b[:lo], a[:hi + 1] != b[:hi + 1]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class HeadIndex:
    """Per chain position (the hash of the full blocks before it, -1 at the start), entries
    (token_ids, key) kept in token order: the entry sharing the longest head with a query is one of
    the query's two neighbours in that order, so a lookup is a bisect and two compares."""

    __slots__ = ("_entries",)

    def __init__(self):
        self._entries: dict[int, list[tuple[list[int], int]]] = {}

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._entries.values())

    def add(self, parent_hash: int, token_ids: list[int], key: int) -> None:
        insort(self._entries.setdefault(parent_hash, []), (token_ids, key))

    def remove(self, parent_hash: int, token_ids: list[int], key: int) -> None:
        entries = self._entries[parent_hash]
        i = bisect_left(entries, (token_ids, key))
        assert entries[i][1] == key, "removing an entry that was never added"
        del entries[i]
        if not entries:
            del self._entries[parent_hash]

    def longest_match(self, parent_hash: int, token_ids: list[int]) -> tuple[int, int]:
        """(key, number of leading tokens shared) of the best entry, or (-1, 0)."""
        entries = self._entries.get(parent_hash)
        if not entries:
            return -1, 0
        i = bisect_left(entries, (token_ids,))  # (token_ids,) sorts before every (token_ids, key)
        best_key, best_len = -1, 0
        for j in (i - 1, i):
            if 0 <= j < len(entries):
                n = common_prefix_len(entries[j][0], token_ids)
                if n > best_len:
                    best_key, best_len = entries[j][1], n
        return best_key, best_len
