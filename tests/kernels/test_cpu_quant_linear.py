"""The int8/int4 CPU linear (kernels/cpu/quant_linear.cpp): int8 activations bit for bit the reference's, float
activations within float32 accumulation error of the exact product, for every bit width, zero point, group size
and row count; a row's output independent of the other rows and the thread count; the packed layout's size."""
import pytest
import torch

from tpengine.kernels.cpu.quant_linear import (available, dequantize_rows, pack, quant_linear,
                                               quant_linear_reference)
from tpengine.quantization.weights import QuantizedWeight

pytestmark = pytest.mark.skipif(not available(), reason="no C++ compiler to build the quantized linear")

ROWS = [1, 2, 3, 7, 16, 64, 300]
OUT_FEATURES = 203  # not a whole number of 8-output blocks


def random_weight(bits, out_features, in_features, group_size, with_zeros, seed=0) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    low, high = -2 ** (bits - 1), 2 ** (bits - 1)
    num_groups = -(-in_features // group_size)
    qweight = torch.randint(low, high, (out_features, in_features), generator=g, dtype=torch.int8)
    scales = torch.rand(out_features, num_groups, generator=g) * 0.02 + 0.001
    zeros = torch.randint(low, high, (out_features, num_groups), generator=g).float() if with_zeros else None
    return QuantizedWeight(bits, qweight, scales, zeros, group_size)


def packed(weight: QuantizedWeight, activation: str):
    return pack(weight.qweight, weight.scales, weight.zeros, weight.bits, weight.group_size, activation)


def reference(x, weight: QuantizedWeight, activation, bias=None):
    out = quant_linear_reference(x, weight.qweight, weight.scales, weight.zeros, weight.group_size, activation)
    return out if bias is None else out + bias


def float_tolerance(x, weight: QuantizedWeight):
    """Elementwise bound on float32 FMA chains over `in` terms against the exact sum: a few units of rounding
    times sqrt(in), relative to the sum of the terms' magnitudes."""
    magnitude = x.double().abs().reshape(-1, x.size(-1)) @ weight.dequantize().double().abs().T
    return 4 * 2.0 ** -24 * weight.shape[1] ** 0.5 * magnitude.view(*x.shape[:-1], -1) + 1e-30


# (in_features, group_size): groups of 32, 64, 128, and one per output channel, also with in not a multiple of 8
GROUPINGS = [(256, 32), (256, 64), (384, 128), (256, 256), (212, 212)]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("with_zeros", [False, True])
@pytest.mark.parametrize("in_features, group_size", GROUPINGS)
@pytest.mark.parametrize("rows", ROWS)
def test_int8_activations_match_the_reference_bit_for_bit(bits, with_zeros, in_features, group_size, rows):
    weight = random_weight(bits, OUT_FEATURES, in_features, group_size, with_zeros, seed=rows)
    bias = torch.randn(OUT_FEATURES) if rows % 2 else None
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)) * 3
    out = quant_linear(x, packed(weight, "int8"), bias)
    assert out.shape == (rows, OUT_FEATURES) and out.dtype == torch.float32
    assert torch.equal(out, reference(x, weight, "int8", bias))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("with_zeros", [False, True])
@pytest.mark.parametrize("in_features, group_size", GROUPINGS)
@pytest.mark.parametrize("rows", ROWS)
def test_float_activations_match_the_exact_product_within_float32_accumulation(bits, with_zeros, in_features,
                                                                               group_size, rows):
    weight = random_weight(bits, OUT_FEATURES, in_features, group_size, with_zeros, seed=rows)
    bias = torch.randn(OUT_FEATURES) if rows % 2 else None
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    out = quant_linear(x, packed(weight, "float"), bias)
    assert out.shape == (rows, OUT_FEATURES) and out.dtype == torch.float32
    expected = reference(x, weight, "float")
    assert ((out - (0 if bias is None else bias) - expected).abs() <= float_tolerance(x, weight)).all()


@pytest.mark.parametrize("activation", ["int8", "float"])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("out_features", [1003, 61])  # 61: a lone row's pass over blocks ends in a partial block
# 509 inputs, one group: a lone row's last step has 1 input of x, and its padding no x
@pytest.mark.parametrize("in_features, group_size", [(512, 64), (509, 509)])
def test_a_rows_output_does_not_depend_on_the_other_rows_or_the_thread_count(activation, bits, out_features,
                                                                             in_features, group_size):
    weight = random_weight(bits, out_features, in_features, group_size, with_zeros=True)
    weights = packed(weight, activation)
    x = torch.randn(300, in_features)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([quant_linear(x[m:m + 1], weights) for m in (0, 5, 299)])
        one_thread = quant_linear(x, weights)
        torch.set_num_threads(2)
        two_threads = quant_linear(x, weights)
        # a few rows take another path than many (float activations: dequantized in registers, not into tiles)
        small_batches = [quant_linear(x[:rows], weights) for rows in (2, 7)]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, two_threads)
    assert torch.equal(alone, two_threads[[0, 5, 299]])
    for small_batch in small_batches:
        assert torch.equal(small_batch, two_threads[:small_batch.size(0)])


def test_int8_weights_of_minus_128_multiply_negative_inputs_with_the_right_sign():
    qweight = torch.full((16, 64), -128, dtype=torch.int8)  # |-128| is no int8: the kernel reads it unsigned
    weight = QuantizedWeight(8, qweight, torch.ones(16, 1), None, 64)
    x = -torch.ones(2, 64)
    out = quant_linear(x, packed(weight, "int8"))
    assert torch.allclose(out, torch.full((2, 16), 128.0 * 64))  # xq = -127, sx = 1 / 127
    assert torch.equal(out, reference(x, weight, "int8"))


def test_a_zero_row_gives_the_bias_alone():
    weight = random_weight(4, 40, 64, 32, with_zeros=True)
    bias = torch.randn(40)
    x = torch.zeros(3, 64)
    x[1] = torch.randn(64)
    out = quant_linear(x, packed(weight, "int8"), bias)
    assert torch.equal(out[0], bias) and torch.equal(out[2], bias)
    assert torch.equal(out, reference(x, weight, "int8", bias))


@pytest.mark.parametrize("activation", ["int8", "float"])
def test_takes_strided_batched_and_bfloat16_inputs(activation):
    weight = random_weight(4, 70, 128, 64, with_zeros=False)
    weights = packed(weight, activation)
    wide = torch.randn(3, 4, 131)
    x = wide[..., 1:129]  # rows 131 apart, not contiguous
    out = quant_linear(x, weights)
    assert out.shape == (3, 4, 70)
    assert torch.equal(out, quant_linear(x.contiguous(), weights))
    if activation == "int8":
        assert torch.equal(out, reference(x, weight, "int8"))
    halves = x.bfloat16()
    out_bf16 = quant_linear(halves, weights)
    assert out_bf16.dtype == torch.bfloat16
    assert torch.equal(out_bf16, quant_linear(halves.float(), weights).bfloat16())


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("with_zeros", [False, True])
@pytest.mark.parametrize("in_features, group_size", GROUPINGS)
def test_dequantize_rows_gives_the_weights_rows_exactly(bits, with_zeros, in_features, group_size):
    weight = random_weight(bits, OUT_FEATURES, in_features, group_size, with_zeros)
    rows = torch.tensor([0, 202, 7, 8, 7, 100])
    for activation in ("int8", "float"):
        assert torch.equal(dequantize_rows(packed(weight, activation), rows), weight.dequantize()[rows])
    with pytest.raises(RuntimeError, match="row 203 is not in"):
        dequantize_rows(packed(weight, "float"), torch.tensor([1, 203]))


@pytest.mark.parametrize("bits, group_size, most_bytes_per_param", [(8, 1024, 1.1), (8, 128, 1.1), (4, 1024, 0.6),
                                                                     (4, 128, 0.6)])
def test_packed_weights_keep_their_resident_bytes_per_parameter(bits, group_size, most_bytes_per_param):
    """The aims against bfloat16's 2 bytes a parameter: int8 at most 0.55x, int4 at most 0.3x, scales included."""
    weight = random_weight(bits, 1024, 1024, group_size, with_zeros=True)
    weights = packed(weight, "int8")
    if bits == 4:
        assert weights.weight.numel() == 1024 * 1024 // 2  # two values a byte
    assert weights.resident_bytes() / (1024 * 1024) <= most_bytes_per_param


@pytest.mark.parametrize("change, message", [
    (dict(bits=3), "bits must be 4 or 8"),
    (dict(activation="fp8"), "activation must be one of"),
    (dict(group_size=12, scales=torch.ones(8, 4)), "must be a multiple of 8"),
    (dict(group_size=32), "do not cover in_features"),
    (dict(qweight=torch.full((8, 48), 8, dtype=torch.int8)), r"int4 qweight values must lie in \[-8, 7\]"),
    (dict(zeros=torch.full((8, 3), 0.5)), "zeros must be whole numbers"),
    (dict(qweight=torch.zeros(8, 48)), "qweight must be int8"),
    (dict(scales=torch.ones(8, 3, dtype=torch.float64)), "scales must be float32"),
])
def test_arguments_the_kernel_cannot_take_are_refused(change, message):
    arguments = dict(qweight=torch.zeros(8, 48, dtype=torch.int8), scales=torch.ones(8, 3), zeros=None, bits=4,
                     group_size=16, activation="int8")
    with pytest.raises(ValueError, match=message):
        pack(**{**arguments, **change})


def test_an_input_of_another_width_is_refused():
    weights = packed(random_weight(8, 16, 64, 64, with_zeros=False), "int8")
    with pytest.raises(ValueError, match="x has 65 features, the weight takes 64"):
        quant_linear(torch.randn(2, 65), weights)


def test_int8_activations_round_halves_to_even_in_the_vector_and_the_scalar_loop():
    # max |x| = 127 makes the scale 1, so x / scale is exactly each half: the first 32 inputs go through the vector
    # loop (on AVX2), the rest through the scalar one
    halves = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5])
    x = torch.cat([torch.tensor([127.0]), halves.repeat(4), halves[:7]]).unsqueeze(0)
    weight = random_weight(8, OUT_FEATURES, x.size(1), x.size(1), with_zeros=False)
    assert torch.equal(quant_linear(x, packed(weight, "int8")), reference(x, weight, "int8"))
