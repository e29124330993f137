"""The int4/int8 Triton GEMM (kernels/triton/quant_matmul.py) against the dequantized weight's float32 product (on
CPU under TRITON_INTERPRET=1): every bit width, group size and zero point, decode and prefill row counts, split along
K or not, act order, and through the CUDA platform's pack/linear with tensor-parallel shards; with int8 activations
(W8A8), the CPU kernel's reference bit for bit."""
from dataclasses import replace

import pytest
import torch

from tests.conftest import relative_error
from tests.kernels.conftest import DEVICE
from tests.quantization.checkpoints import CheckpointFormat, quantize_linear
from tpengine.kernels.cpu.quant_linear import quant_linear_reference
from tpengine.platforms import cuda, torch_ops
from tpengine.quantization.weights import QuantizedWeight

pytest.importorskip("triton")
from tpengine.kernels.triton.quant_matmul import (COMPILE_CASES, _quant_matmul_kernel, block_config,  # noqa: E402
                                                  dequantize_rows, pack_weight, quant_matmul)

OUT_FEATURES = 67  # one whole 64-column block and a partial one


def random_weight(bits, out_features, in_features, group_size, with_zeros, seed=0) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    low, high = -2 ** (bits - 1), 2 ** (bits - 1)
    group_size = group_size or in_features
    num_groups = in_features // group_size
    qweight = torch.randint(low, high, (out_features, in_features), generator=g, dtype=torch.int8)
    scales = torch.rand(out_features, num_groups, generator=g) * 0.02 + 0.001
    zeros = torch.randint(low, high, (out_features, num_groups), generator=g).float() if with_zeros else None
    return QuantizedWeight(bits, qweight, scales, zeros, group_size).to(DEVICE)


def packed(weight: QuantizedWeight):
    return pack_weight(weight.qweight, weight.scales, weight.zeros, weight.bits, weight.group_size)


def reference(x, weight: QuantizedWeight, bias=None):
    out = x.float() @ weight.dequantize().T
    return out if bias is None else out + bias.float()


# float32 accumulation in another order than torch's: a few ulps of the largest output
FLOAT32_TOLERANCE = 1e-5
BFLOAT16_TOLERANCE = 2 ** -7  # the output rounded to bfloat16 (truncated, in the interpreter), relative to its largest


@pytest.mark.parametrize("bits, group_size, with_zeros, in_features", [
    (4, 32, True, 128),     # split along K at every row count: groups of 32 make four K blocks a split
    (4, 128, False, 256),
    (4, None, True, 96),    # one group per output channel, K not a whole number of K blocks
    (8, 32, False, 128),
    (8, 128, True, 256),
    (8, None, False, 96),
])
def test_float32_inputs_equal_the_dequantized_weights_product(bits, group_size, with_zeros, in_features):
    weight = random_weight(bits, OUT_FEATURES, in_features, group_size, with_zeros, seed=bits)
    matmul_weight = packed(weight)
    for rows in (1, 5, 33):  # decode, a few sequences, prefill-ish (a second M tile shape)
        x = torch.randn(rows, in_features, device=DEVICE)
        out = quant_matmul(x, matmul_weight)
        assert out.dtype == torch.float32 and out.shape == (rows, OUT_FEATURES)
        assert relative_error(out, reference(x, weight)) < FLOAT32_TOLERANCE


@pytest.mark.parametrize("bits, group_size, with_zeros, rows", [(4, 128, True, 5), (8, None, False, 33)])
def test_bfloat16_inputs_give_bfloat16_within_its_rounding(bits, group_size, with_zeros, rows):
    weight = random_weight(bits, OUT_FEATURES, 256, group_size, with_zeros, seed=rows)
    x = torch.randn(rows, 256, device=DEVICE).to(torch.bfloat16)
    bias = torch.randn(OUT_FEATURES, device=DEVICE).to(torch.bfloat16)
    out = quant_matmul(x, packed(weight), bias)
    assert out.dtype == torch.bfloat16 and relative_error(out, reference(x, weight, bias)) < BFLOAT16_TOLERANCE


def test_a_split_along_k_adds_the_bias_once_and_equals_no_split():
    weight = random_weight(4, OUT_FEATURES, 256, 32, True)
    x = torch.randn(3, 256, device=DEVICE)
    bias = torch.randn(OUT_FEATURES, device=DEVICE)
    one = block_config(3, OUT_FEATURES, 256, 32)._replace(split_k=1)
    split = one._replace(split_k=4)
    expected = reference(x, weight, bias)
    for config in (one, split):
        assert relative_error(quant_matmul(x, packed(weight), bias, config), expected) < FLOAT32_TOLERANCE


def test_takes_batched_strided_inputs_and_no_rows():
    weight = random_weight(8, OUT_FEATURES, 128, 64, False)
    x = torch.randn(2, 3, 256, device=DEVICE)[..., ::2]  # every other column: not contiguous
    out = quant_matmul(x, packed(weight))
    assert out.shape == (2, 3, OUT_FEATURES) and relative_error(out, reference(x, weight)) < FLOAT32_TOLERANCE
    assert quant_matmul(torch.randn(0, 128, device=DEVICE), packed(weight)).shape == (0, OUT_FEATURES)


def test_decode_splits_k_and_prefill_does_not():
    assert block_config(1, 4096, 4096, 128).split_k == 8
    assert block_config(512, 4096, 4096, 128).split_k == 1
    assert block_config(1, 4096, 4096, 32).block_k == 32  # a K block never crosses a group's end


# --- through the CUDA platform's functions, on CPU tensors ---------------------------------------

def gptq_act_order_weight(sym: bool, in_features: int = 128, out_features: int = OUT_FEATURES) -> QuantizedWeight:
    """A GPTQ desc_act weight: groups of 32 over a random permutation of the input columns."""
    g = torch.Generator().manual_seed(5)
    float_weight = torch.randn(out_features, in_features, generator=g) / in_features ** 0.5
    return quantize_linear(float_weight, CheckpointFormat("gptq", group_size=32, desc_act=True, sym=sym), g,
                           torch.float16).to(DEVICE)


@pytest.mark.parametrize("sym", [True, False])
def test_act_order_weights_gather_their_input_columns_in_the_kernel(sym):
    weight = gptq_act_order_weight(sym)
    matmul_weight = cuda.pack_quantized_weight(weight, torch.float32)
    assert matmul_weight.input_order is not None
    x = torch.randn(5, 128, device=DEVICE)
    bias = torch.randn(OUT_FEATURES, device=DEVICE)
    out = cuda.linear(x, torch.empty(0), bias, matmul_weight)
    assert relative_error(out, reference(x, weight, bias)) < FLOAT32_TOLERANCE


def test_tensor_parallel_shards_pack_and_compute_their_part_of_the_whole():
    weight = gptq_act_order_weight(sym=False)
    x = torch.randn(3, 128, device=DEVICE)
    whole = reference(x, weight)
    # column parallel: each rank's output features
    rows = [cuda.linear(x, torch.empty(0), None, cuda.pack_quantized_weight(weight.rows(start, length), torch.float32))
            for start, length in ((0, 40), (40, OUT_FEATURES - 40))]
    assert relative_error(torch.cat(rows, dim=1), whole) < FLOAT32_TOLERANCE
    # row parallel: each rank's input features, act-order groups split between ranks (padded columns weigh 0)
    partial_sums = []
    for rank in range(2):
        shard = cuda.pack_quantized_weight(weight.columns(rank * 64, 64, 2), torch.float32)
        assert shard.in_features == 64 and shard.packed_columns > 64
        partial_sums.append(cuda.linear(x[:, rank * 64:(rank + 1) * 64], torch.empty(0), None, shard))
    assert relative_error(sum(partial_sums), whole) < FLOAT32_TOLERANCE


@pytest.mark.parametrize("bits, with_zeros", [(4, True), (4, False), (8, True)])
def test_embedding_rows_are_the_dequantized_rows_exactly(bits, with_zeros):
    weight = random_weight(bits, 50, 64, 32, with_zeros)
    table = cuda.pack_quantized_weight(weight, torch.float32)
    token_ids = torch.tensor([[3, 49, 0], [7, 7, 12]], device=DEVICE)
    assert torch.equal(cuda.embedding_rows(token_ids, table, torch.float32), weight.dequantize()[token_ids])
    assert torch.equal(dequantize_rows(table, token_ids.flatten()), weight.dequantize()[token_ids.flatten()])


def test_weights_the_kernel_does_not_take_keep_their_float_value():
    odd_groups = random_weight(4, 8, 64, 8, False)  # groups of 8: under tl.dot's 16
    int8_x_groups_of_16 = replace(random_weight(8, 8, 96, 16, False), activation="int8")  # int8 tl.dot: K >= 32
    for weight in (odd_groups, int8_x_groups_of_16):
        kept = cuda.pack_quantized_weight(weight, torch.bfloat16)
        assert type(kept) is torch_ops.DequantizedWeight
        assert torch.equal(kept.weight, weight.dequantize(torch.bfloat16))


def test_int4_weights_take_about_a_quarter_of_bfloat16s_bytes():
    weight = random_weight(4, 256, 1024, 128, True)
    matmul_weight = packed(weight)
    assert matmul_weight.resident_bytes() / (2 * 256 * 1024) < 0.29  # 0.5 + 8 / 128 bytes per parameter, of 2


def test_compile_cases_name_every_kernel_argument_in_order():
    assert len(COMPILE_CASES) == 13 and len({case["name"] for case in COMPILE_CASES}) == 13
    for case in COMPILE_CASES:
        assert list(case["signature"]) == _quant_matmul_kernel.arg_names
        assert all(case["signature"][name] == "constexpr" for name in case["constexprs"])


# --- int8 activations (W8A8): the CPU kernel's numbers, bit for bit ---------------------------------

@pytest.mark.parametrize("bits, group_size, with_zeros, dtype", [
    (8, None, False, torch.float32),   # a W8A8 checkpoint: int8 weights per channel, symmetric
    (8, 32, True, torch.float32),      # groups fold into float32 one by one; zeros make q - zero overflow int8
    (4, 64, True, torch.bfloat16),
])
def test_int8_activations_equal_the_cpu_reference_bit_for_bit(bits, group_size, with_zeros, dtype):
    weight = replace(random_weight(bits, OUT_FEATURES, 128, group_size, with_zeros), activation="int8")
    matmul_weight = cuda.pack_quantized_weight(weight, dtype)
    x = torch.randn(5, 128, device=DEVICE).to(dtype)
    x[2] = 0  # a zero row: the bias alone
    bias = torch.randn(OUT_FEATURES, device=DEVICE)
    out = cuda.linear(x, torch.empty(0), bias, matmul_weight)
    expected = quant_linear_reference(x, weight.qweight, weight.scales, weight.zeros, weight.group_size, "int8")
    assert out.dtype == dtype and torch.equal(out, rounded_as_the_kernel_rounds(expected + bias, dtype))


def rounded_as_the_kernel_rounds(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype as the kernel's float32 -> dtype conversion rounds: to nearest on a GPU; Triton's interpreter
    truncates to bfloat16."""
    if dtype == torch.bfloat16 and t.device.type == "cpu":
        return (t.view(torch.int32) & -65536).view(torch.float32).to(dtype)
    return t.to(dtype)
