"""How the CPU runner cuts a prefill step into passes: sizes, cached offsets, and which rows end a chunk."""
from types import SimpleNamespace

from tpengine.distributed.messages import PrefillSeq, StepMessage
from tpengine.runner.model_runner import ModelRunner


def passes_of(chunks: list[tuple[int, int]], pass_tokens: int):
    """chunks[b] = (cached tokens, new tokens); returns [(pieces as (cached, new), end rows)] per pass."""
    step = StepMessage(prefill=[PrefillSeq(list(range(new)), cached, [b]) for b, (cached, new) in enumerate(chunks)],
                       decode=[])
    runner = SimpleNamespace(prefill_pass_tokens=pass_tokens)
    return [([(p.num_cached_tokens, len(p.token_ids)) for p in piece.prefill], ends)
            for piece, ends in ModelRunner.prefill_passes(runner, step)]


def test_small_step_is_one_pass():
    assert passes_of([(0, 5), (16, 3)], 100) == [([(0, 5), (16, 3)], [0, 1])]


def test_long_chunk_is_split_and_only_its_last_piece_ends_it():
    assert passes_of([(0, 3), (32, 10), (0, 2)], 4) == [
        ([(0, 3), (32, 1)], [0]),
        ([(33, 4)], []),
        ([(37, 4)], []),
        ([(41, 1), (0, 2)], [0, 1]),
    ]


def test_pass_that_fills_exactly_closes_there():
    assert passes_of([(0, 4), (0, 4)], 4) == [([(0, 4)], [0]), ([(0, 4)], [0])]


def test_every_token_is_in_exactly_one_piece_in_order():
    chunks = [(0, 17), (5, 1), (48, 33), (0, 2048), (0, 1)]
    pieces = [piece for piece_list, _ in passes_of(chunks, 100) for piece in piece_list]
    assert all(sum(n for _, n in piece_list) <= 100 for piece_list, _ in passes_of(chunks, 100))
    rebuilt, i = [], 0
    for cached, new in chunks:
        covered = cached
        while covered < cached + new:
            piece_cached, piece_new = pieces[i]
            assert piece_cached == covered
            covered += piece_new
            i += 1
        rebuilt.append(covered - cached)
    assert rebuilt == [new for _, new in chunks] and i == len(pieces)
