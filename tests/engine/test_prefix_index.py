"""HeadIndex: the longest shared head under one chain position, found by bisect among token-ordered entries."""
import random

import pytest

from tpengine.engine.prefix_index import HeadIndex, common_prefix_len


def brute_common_prefix_len(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("seed", range(5))
def test_common_prefix_len_equals_a_token_by_token_count(seed):
    rng = random.Random(seed)
    for _ in range(500):
        head = [rng.randrange(3) for _ in range(rng.randint(0, 20))]
        a = head + [rng.randrange(3) for _ in range(rng.randint(0, 5))]
        b = head + [rng.randrange(3) for _ in range(rng.randint(0, 5))]
        assert common_prefix_len(a, b) == brute_common_prefix_len(a, b)


@pytest.mark.parametrize("seed", range(5))
def test_longest_match_is_the_best_entry_under_that_parent(seed):
    rng = random.Random(seed)
    index, live = HeadIndex(), {}
    for key in range(300):
        parent = rng.randrange(3)
        tokens = [rng.randrange(3) for _ in range(rng.randint(1, 8))]
        index.add(parent, tokens, key)
        live[key] = (parent, tokens)
        if rng.random() < 0.3:  # eviction
            gone = rng.choice(list(live))
            index.remove(*live.pop(gone), gone)
        query = [rng.randrange(3) for _ in range(rng.randint(1, 8))]
        query_parent = rng.randrange(3)
        best = max((brute_common_prefix_len(t, query) for p, t in live.values() if p == query_parent), default=0)
        key_found, n = index.longest_match(query_parent, query)
        assert n == best
        if best:
            assert live[key_found][0] == query_parent
            assert brute_common_prefix_len(live[key_found][1], query) == best
        else:
            assert key_found == -1
    assert len(index) == len(live)


def test_an_entry_under_another_parent_never_matches():
    index = HeadIndex()
    index.add(1, [5, 6, 7], key=0)
    assert index.longest_match(2, [5, 6, 7]) == (-1, 0)
    assert index.longest_match(1, [5, 6, 9]) == (0, 2)
