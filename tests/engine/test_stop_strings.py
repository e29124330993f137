"""Stop-string matching by KMP: the same matches and held-back tails as a plain search of the whole text,
in memory linear in the stop strings however long they are."""
import random
import tracemalloc

from tpengine.engine.stop_strings import StopMatcher, StopStrings


def naive(text: str, old_len: int, stops: tuple[str, ...]) -> tuple[str, int] | None:
    """The earliest-starting stop string that ends in text[old_len:] (the first listed among equals)."""
    best = None
    for stop in stops:
        at = text.find(stop, max(0, old_len - len(stop) + 1))
        if at != -1 and (best is None or at < best[1]):
            best = (stop, at)
    return best


def naive_held_back(text: str, stops: tuple[str, ...]) -> int:
    return max((k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)


def test_matches_and_held_back_tails_equal_a_plain_search_on_random_texts():
    rng = random.Random(0)
    for trial in range(400):
        alphabet = "ab" if trial % 2 else "abc"
        stops = tuple("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 7)))
                      for _ in range(rng.randint(1, 3)))
        matcher = StopMatcher(StopStrings(stops))
        text, min_len = "", rng.randint(0, 6)  # below min_len a match only advances the states (min_tokens)
        for _ in range(30):
            old_len = len(text)
            text += "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
            report = len(text) >= min_len
            found = matcher.feed(text, old_len, report)
            if not report:
                assert found is None
                continue
            assert found == naive(text, old_len, stops), (stops, text, old_len)
            if found is not None:
                break
            assert matcher.num_held_back == naive_held_back(text, stops), (stops, text)


def test_a_long_stop_string_that_keeps_almost_matching_costs_memory_linear_in_its_length():
    # "xy" * 8000 against a text of "xy" pairs: every step extends the match. Every prefix of the stop
    # string materialized would be 8000 * 16000 characters (128 MB); the failure table is 16000 numbers.
    stop = "xy" * 8000
    stops = StopStrings((stop, "zz"))
    matchers = [StopMatcher(stops) for _ in range(4)]  # a request's n completions share the tables
    tracemalloc.start()
    try:
        texts = [""] * len(matchers)
        for _ in range(7999):
            for i, matcher in enumerate(matchers):
                old_len = len(texts[i])
                texts[i] += "xy"
                assert matcher.feed(texts[i], old_len, True) is None
        assert all(m.num_held_back == 15998 for m in matchers)
        assert matchers[0].feed(texts[0] + "xy", len(texts[0]), True) == (stop, 0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * 1024 * 1024, peak  # the texts themselves are 64 KB each
