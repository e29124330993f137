"""The bfloat16 linear: float32-accumulated products of bfloat16 rows (AVX512-BF16) or of float32 rows (AVX2) against
a block-packed bfloat16 weight, for any number of rows, output features that fill no whole block, bias or none, and
strided inputs; and the rows of a packed table, as an embedding reads them."""
import pytest
import torch
import torch.nn.functional as F

from tests.conftest import relative_error
from tpengine.kernels.cpu.bf16_linear import available, bf16_linear, float_rows_available, pack_weight, packed_rows

needs_bf16_rows = pytest.mark.skipif(not available(), reason="this CPU has no AVX512-BF16 (or no C++ compiler)")
needs_float_rows = pytest.mark.skipif(not float_rows_available(), reason="this CPU has no AVX2 and FMA (or no compiler)")
ROWS = [1, 2, 3, 4, 5, 6, 7, 13, 64, 300]
SHAPES = [(64, 32), (200, 96), (1003, 64), (40, 30)]


# rows of each dtype, and how far the kernel may be from the exact product: bfloat16 rounds its float32 sums once to
# 8 bits; float32 rows meet the bfloat16 weight widened exactly, so only the summation order differs
ROW_DTYPES = [pytest.param(torch.bfloat16, 1e-2, marks=needs_bf16_rows, id="bfloat16-rows"),
              pytest.param(torch.float32, 1e-5, marks=needs_float_rows, id="float32-rows")]


def reference(x, weight, bias):
    """The exact product, rounded once to x's dtype."""
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double()).to(x.dtype)


@pytest.mark.parametrize("dtype, tolerance", ROW_DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("out_features, in_features", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_the_exact_product_rounded_once(dtype, tolerance, rows, out_features, in_features, with_bias):
    g = torch.Generator().manual_seed(rows * out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=g).bfloat16()
    bias = torch.randn(out_features, generator=g).to(dtype) if with_bias else None
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    out = bf16_linear(x, pack_weight(weight), out_features, bias)
    assert out.dtype == dtype and out.shape == (rows, out_features)
    assert relative_error(out, reference(x, weight, bias)) < tolerance


def test_packing_round_trips_and_pads_the_last_block_with_zeros():
    weight = torch.randn(100, 48).bfloat16()
    packed = pack_weight(weight)
    assert packed.shape == (2, 24, 64, 2)  # [out / 64, in / 2, 64, 2]
    unpacked = packed.permute(0, 2, 1, 3).reshape(128, 48)
    assert torch.equal(unpacked[:100], weight) and not unpacked[100:].any()


@pytest.mark.parametrize("dtype, tolerance", ROW_DTYPES)
def test_takes_strided_and_batched_inputs(dtype, tolerance):
    weight, bias = torch.randn(70, 40).bfloat16(), torch.randn(70).to(dtype)
    # rows that start at odd offsets (not the 4-byte pairs the bfloat16 path reads), with strided columns for float32
    wide = torch.randn(3, 4, 81).to(dtype) if dtype == torch.bfloat16 else torch.randn(3, 81, 4).transpose(1, 2)
    x = wide[..., 1:41]
    out = bf16_linear(x, pack_weight(weight), 70, bias)
    assert out.shape == (3, 4, 70)
    assert relative_error(out, reference(x, weight, bias)) < tolerance


@pytest.mark.parametrize("dtype, tolerance", ROW_DTYPES)
def test_a_packed_weight_of_another_shape_is_refused(dtype, tolerance):
    packed = pack_weight(torch.randn(100, 48).bfloat16())
    with pytest.raises(RuntimeError, match="out_features"):
        bf16_linear(torch.randn(1, 48, dtype=dtype), packed, 300)
    with pytest.raises(RuntimeError, match="in-features"):
        bf16_linear(torch.randn(1, 50, dtype=dtype), packed, 100)


@needs_float_rows
def test_packed_rows_are_the_weight_rows_widened_exactly():
    weight = torch.randn(130, 48).bfloat16()
    rows = torch.tensor([0, 63, 64, 129, 5, 5])
    assert torch.equal(packed_rows(pack_weight(weight), rows), weight[rows].float())
    with pytest.raises(RuntimeError, match="outside the packed weight's 192 rows"):
        packed_rows(pack_weight(weight), torch.tensor([192]))
