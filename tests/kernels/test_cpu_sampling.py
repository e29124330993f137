"""The CPU sampling kernel (kernels/cpu/sampling.cpp) against a float64 inverse CDF in torch."""
import pytest
import torch

from tpengine.kernels.cpu import sampling

pytestmark = pytest.mark.skipif(not sampling.available(), reason="the CPU sampling kernel does not build here")


def reference(logits: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor) -> tuple[list[int], list]:
    """Per row: the float64 inverse-CDF token, and the cumulative distribution's boundaries around the draw."""
    x = logits.double() / temperatures.double().clamp(min=1e-30).unsqueeze(1)
    probs = torch.exp(x - x.max(-1, keepdim=True).values)
    cdf = probs.cumsum(-1) / probs.sum(-1, keepdim=True)
    tokens = torch.searchsorted(cdf, uniforms.unsqueeze(1), right=True).squeeze(1).clamp(max=logits.size(1) - 1)
    return tokens.tolist(), cdf


def near_a_boundary(cdf_row: torch.Tensor, u: float, tolerance: float = 1e-6) -> bool:
    return bool(((cdf_row - u).abs() < tolerance).any())


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 255, 256, 257, 1000, 4099])
def test_draws_equal_a_float64_inverse_cdf_away_from_the_boundaries(vocab):
    generator = torch.Generator().manual_seed(vocab)
    rows = 48
    logits = torch.randn(rows, vocab, generator=generator) * 3
    temperatures = torch.rand(rows, generator=generator) * 1.5 + 0.05
    uniforms = torch.rand(rows, dtype=torch.float64, generator=generator)
    got = sampling.sample_rows(logits, temperatures, uniforms).tolist()
    expected, cdf = reference(logits, temperatures, uniforms)
    checked = [r for r in range(rows) if not near_a_boundary(cdf[r], uniforms[r].item())]
    assert len(checked) > rows // 2
    assert [got[r] for r in checked] == [expected[r] for r in checked]


def test_temperature_zero_is_the_first_of_equal_maxima():
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(1))
    logits[2, 7] = logits[2, 250] = 50.0  # a tie: the first wins, as argmax
    logits[3, 299] = 60.0  # in the scalar tail
    got = sampling.sample_rows(logits, torch.zeros(6), torch.rand(6, dtype=torch.float64))
    assert got.tolist() == logits.argmax(-1).tolist() and got[2] == 7


def test_rows_without_a_finite_maximum_or_with_a_nan_get_minus_one():
    logits = torch.randn(5, 100)
    logits[0, 33] = float("nan")
    logits[1] = float("-inf")
    logits[2, 5] = float("inf")
    logits[3, 99] = float("nan")  # in the scalar tail
    for temperature in (0.0, 0.8):
        got = sampling.sample_rows(logits, torch.full((5,), temperature), torch.full((5,), 0.5, dtype=torch.float64))
        assert got[:4].tolist() == [-1, -1, -1, -1] and 0 <= got[4] < 100


def test_masked_entries_are_never_drawn_even_at_the_ends_of_the_uniform_range():
    vocab = 700
    logits = torch.randn(1, vocab)
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[[3, 256, 511, 512, 640]] = True  # the last allowed one is not the last entry
    logits[0, ~allowed] = float("-inf")
    uniforms = [0.0, 1e-300, 0.25, 0.5, 0.999999, 1.0 - 2.0 ** -53] + torch.rand(200, dtype=torch.float64).tolist()
    for u in uniforms:
        [token] = sampling.sample_rows(logits, torch.tensor([1.3]), torch.tensor([u], dtype=torch.float64)).tolist()
        assert allowed[token], (u, token)
    first = sampling.sample_rows(logits, torch.tensor([1.3]), torch.tensor([0.0], dtype=torch.float64))
    last = sampling.sample_rows(logits, torch.tensor([1.3]), torch.tensor([1.0 - 2.0 ** -53], dtype=torch.float64))
    assert first.item() == 3 and last.item() == 640


def test_a_row_gets_the_same_token_alone_in_a_batch_and_on_any_number_of_threads():
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(64, 5000, generator=generator)
    temperatures = torch.rand(64, generator=generator) + 0.2
    temperatures[::5] = 0.0
    uniforms = torch.rand(64, dtype=torch.float64, generator=generator)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [sampling.sample_rows(logits[r:r + 1], temperatures[r:r + 1], uniforms[r:r + 1]).item()
                 for r in range(64)]
        torch.set_num_threads(max(2, threads))
        batched = sampling.sample_rows(logits, temperatures, uniforms).tolist()
    finally:
        torch.set_num_threads(threads)
    assert alone == batched


def test_strided_rows_are_read_in_place():
    wide = torch.randn(8, 600)
    view = wide[:, :513]
    temperatures, uniforms = torch.full((8,), 0.9), torch.rand(8, dtype=torch.float64)
    assert torch.equal(sampling.sample_rows(view, temperatures, uniforms),
                       sampling.sample_rows(view.contiguous(), temperatures, uniforms))


def test_draws_follow_the_distribution():
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    n = 20000
    logits = probs.log().repeat(n, 1)
    tokens = sampling.sample_rows(logits, torch.ones(n), torch.rand(n, dtype=torch.float64))
    freq = torch.bincount(tokens, minlength=5).double() / n
    assert torch.allclose(freq, probs.double(), atol=0.015)


def test_bad_arguments_are_refused():
    logits = torch.randn(2, 10)
    with pytest.raises(RuntimeError, match="float32"):
        sampling.sample_rows(logits.double(), torch.ones(2), torch.rand(2, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="temperatures"):
        sampling.sample_rows(logits, torch.ones(3), torch.rand(2, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="uniforms"):
        sampling.sample_rows(logits, torch.ones(2), torch.rand(2))


@pytest.mark.parametrize("num_slices", [2, 3, 4])
def test_slices_as_tensor_parallel_ranks_hold_them_draw_what_the_whole_row_draws(num_slices):
    generator = torch.Generator().manual_seed(10 + num_slices)
    rows, vocab = 64, 1001  # slices of 501, 334 and 251 columns: blocks and vector tails do not line up
    logits = torch.randn(rows, vocab, generator=generator) * 3
    temperatures = torch.rand(rows, generator=generator) + 0.1
    temperatures[::4] = 0.0
    uniforms = torch.rand(rows, dtype=torch.float64, generator=generator)
    whole = sampling.sample_rows(logits, temperatures, uniforms).tolist()
    sliced = sampling.sample_rows(logits, temperatures, uniforms, num_slices).tolist()
    expected, cdf = reference(logits, temperatures, uniforms)
    for r in range(rows):
        if temperatures[r] == 0:
            assert sliced[r] == whole[r] == logits[r].argmax().item()
        elif not near_a_boundary(cdf[r], uniforms[r].item()):
            assert sliced[r] == whole[r] == expected[r], r


def test_slices_keep_the_first_of_equal_maxima_and_a_nan_in_any_slice_spoils_the_row():
    logits = torch.randn(3, 40)
    logits[0, 25] = logits[0, 35] = logits[0, 5] = 9.0  # maxima in slices 0 and 1 of two
    logits[1, 30] = float("nan")  # only slice 1 sees it
    logits[2] = float("-inf")
    for temperature in (0.0, 1.0):
        tokens = sampling.sample_rows(logits, torch.full((3,), temperature), torch.full((3,), 0.3, dtype=torch.float64), 2)
        assert tokens[1:].tolist() == [-1, -1]
    tokens = sampling.sample_rows(logits, torch.zeros(3), torch.zeros(3, dtype=torch.float64), 2)
    assert tokens[0] == 5


def test_more_slices_than_the_vocabulary_fills_leave_the_empty_ones_out():
    assert sampling.slice_bounds(5, 4) == [(0, 2), (2, 4), (4, 5), (5, 5)]
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]]).repeat(400, 1)
    uniforms = torch.rand(400, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    temperatures = torch.ones(400)
    assert torch.equal(sampling.sample_rows(logits, temperatures, uniforms, 4),
                       sampling.sample_rows(logits, temperatures, uniforms))
    uniforms[0] = 1.0 - 2.0 ** -53
    assert sampling.sample_rows(logits, temperatures, uniforms, 4)[0] == 4


def _bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """xgrammar's layout of a bool [rows, vocab]: token j is bit j % 32 of int32 word j / 32, the tail's bits set."""
    rows, vocab = allowed.shape
    words = -(-vocab // 32)
    bits = torch.ones(rows, words * 32, dtype=torch.int64)
    bits[:, :vocab] = allowed.long()
    packed = (bits.view(rows, words, 32) << torch.arange(32)).sum(-1)
    return torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)


@pytest.mark.parametrize("num_slices", [1, 2, 3])
@pytest.mark.parametrize("vocab", [45, 1001, 4099])
def test_a_token_mask_read_in_the_kernel_samples_what_masked_logits_sample(vocab, num_slices):
    """Rows sparse and dense in allowed tokens, whole 16-token runs masked, one row unmasked, NaN and the maximum
    in masked places, greedy and drawn: the mask read inside the kernel gives the token that writing -inf into
    the logits first gives, at every slicing (slice starts off the mask's words)."""
    generator = torch.Generator().manual_seed(vocab + num_slices)
    rows = 40
    logits = torch.randn(rows, vocab, generator=generator) * 3
    density = torch.rand(rows, 1, generator=generator) ** 3  # from almost nothing allowed to almost everything
    allowed = torch.rand(rows, vocab, generator=generator) < density
    allowed[::5, : vocab // 2] = False              # long masked runs
    allowed[1] = True                               # a row its grammar leaves free
    allowed[:, 7] = True                            # every row allows something
    logits[2, ~allowed[2]] = float("nan")           # masked NaNs do not spoil a row
    logits[3] = torch.where(allowed[3], logits[3], torch.full_like(logits[3], 50.0))  # masked maxima lose
    temperatures = torch.rand(rows, generator=generator) + 0.2
    temperatures[::3] = 0.0
    uniforms = torch.rand(rows, dtype=torch.float64, generator=generator)
    masked = logits.masked_fill(~allowed, float("-inf"))
    expected = sampling.sample_rows(masked, temperatures, uniforms, num_slices)
    got = sampling.sample_rows(logits, temperatures, uniforms, num_slices, _bitmask(allowed))
    assert torch.equal(got, expected)
    assert allowed[torch.arange(rows), got].all()


def test_a_bitmask_that_does_not_cover_the_vocabulary_is_refused():
    with pytest.raises(RuntimeError, match="do not cover"):
        sampling.sample_rows(torch.randn(2, 100), torch.ones(2), torch.rand(2, dtype=torch.float64), 1,
                             torch.full((2, 3), -1, dtype=torch.int32))
