"""The Triton fused-MoE kernel equals the grouped torch path (on CPU under TRITON_INTERPRET=1), on float experts
and on int4/int8 quantized ones (against their dequantized float32 values)."""
import logging
from dataclasses import replace

import pytest
import torch

from tests.conftest import relative_error
from tests.kernels.conftest import DEVICE
from tpengine.layers.fused_moe import per_token_experts, select_experts
from tpengine.platforms import cuda
from tpengine.platforms.torch_ops import clamped_swiglu, grouped_experts, silu_and_mul

pytest.importorskip("triton")
from tests.kernels.test_quant_matmul import random_weight  # noqa: E402
from tpengine.kernels.triton.fused_moe import (QuantizedExperts, align_pairs_to_blocks, fused_experts,  # noqa: E402
                                               stack_quantized_experts)
from tpengine.kernels.triton.quant_matmul import QuantMatmulWeight, pack_weight  # noqa: E402


def random_moe(num_tokens, num_experts, hidden, intermediate, top_k, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, intermediate, generator=g) / intermediate ** 0.5
    logits = torch.randn(num_tokens, num_experts, generator=g)
    weights, ids = select_experts(logits, top_k, renormalize=True)
    return [t.to(DEVICE) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights.to(dtype), ids)]


@pytest.mark.parametrize("num_tokens, num_experts, hidden, intermediate, top_k", [
    (1, 8, 64, 32, 2),     # a batch of one token: six experts have none
    (5, 8, 48, 24, 2),     # sizes that are not powers of two
    (37, 4, 64, 96, 3),    # several blocks per expert
])
def test_fused_kernel_equals_the_grouped_torch_path(num_tokens, num_experts, hidden, intermediate, top_k):
    x, w13, w2, weights, ids = random_moe(num_tokens, num_experts, hidden, intermediate, top_k, seed=num_tokens)
    expected = grouped_experts(x, w13, w2, weights, ids)
    out = fused_experts(x, w13, w2, weights, ids, silu_and_mul)
    assert out.shape == expected.shape and relative_error(out, expected) < 1e-5


def test_experts_with_no_tokens_get_no_blocks():
    ids = torch.tensor([[3, 1], [3, 6], [1, 3]])  # pairs 0..5 in row-major order
    sorted_pairs, block_experts = align_pairs_to_blocks(ids, 8, block_m=16)
    assert block_experts.tolist() == [1, 3, 6] + [8] * 5  # 1 + 8 - 1 blocks at most; spare ones name no expert
    assert (sorted_pairs[3 * 16:] == 6).all()
    rows = sorted_pairs[:3 * 16].view(3, 16)
    assert rows[0, :2].tolist() == [1, 4] and rows[1, :3].tolist() == [0, 2, 5] and rows[2, :1].tolist() == [3]
    assert (rows[0, 2:] == 6).all() and (rows[1, 3:] == 6).all() and (rows[2, 1:] == 6).all()


def test_grouped_path_equals_the_per_token_reference():
    x, w13, w2, weights, ids = random_moe(9, 8, 32, 16, 2, seed=3)
    assert relative_error(grouped_experts(x, w13, w2, weights, ids), per_token_experts(x, w13, w2, weights, ids)) < 1e-6


def test_biases_and_the_clamped_swiglu_around_the_fused_kernel_equal_the_grouped_torch_path():
    # gpt-oss's experts on CUDA: the kernel has no biases, the platform adds them around it
    from tpengine.platforms.cuda import moe_experts
    x, w13, w2, _, _ = random_moe(21, 4, 64, 32, 2, seed=7)
    g = torch.Generator().manual_seed(8)
    w13_bias, w2_bias = (torch.randn(4, 64, generator=g).to(DEVICE), torch.randn(4, 64, generator=g).to(DEVICE))
    logits = torch.randn(21, 4, generator=g).to(DEVICE)
    weights, ids = select_experts(logits, 2, renormalize=False, softmax_after_top_k=True)
    act = lambda h: clamped_swiglu(h, alpha=1.702, limit=1.0)  # noqa: E731: a limit that clamps
    expected = grouped_experts(x, w13, w2, weights, ids, act, w13_bias=w13_bias, w2_bias=w2_bias)
    out = moe_experts(x, w13, w2, weights, ids, act, w13_bias=w13_bias, w2_bias=w2_bias)
    assert relative_error(out, expected) < 1e-5


def random_quantized_experts(num_experts, hidden, intermediate, bits, group_size, with_zeros, activation="float"):
    """(w13, w2): each expert's QuantizedWeights, gate/up [2 * intermediate, hidden] and down [hidden, intermediate]."""
    w13 = [random_weight(bits, 2 * intermediate, hidden, group_size, with_zeros, seed=e) for e in range(num_experts)]
    w2 = [random_weight(bits, hidden, intermediate, group_size, with_zeros, seed=100 + e) for e in range(num_experts)]
    return [replace(w, activation=activation) for w in w13], [replace(w, activation=activation) for w in w2]


def dequantized(weights) -> torch.Tensor:
    return torch.stack([w.dequantize() for w in weights])  # float32 [experts, out, in]


def stacked(weights) -> QuantizedExperts:
    return stack_quantized_experts([pack_weight(w.qweight, w.scales, w.zeros, w.bits, w.group_size) for w in weights])


# bfloat16: gate/up rounded to bfloat16 before the activation, the product truncated again (the interpreter)
QUANT_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("bits, group_size, with_zeros, num_experts", [
    (4, 32, True, 8),      # AWQ / GPTQ with zero points: two groups along hidden, two along intermediate
    (4, 32, False, 4),     # symmetric int4 (GPTQ, compressed-tensors W4A16)
    (8, None, False, 6),   # W8A16 per output channel
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_experts_equal_their_dequantized_float32_experts(bits, group_size, with_zeros, num_experts, dtype):
    hidden, intermediate, top_k = 64, 64, 2
    w13, w2 = random_quantized_experts(num_experts, hidden, intermediate, bits, group_size, with_zeros)
    packed13, packed2 = stacked(w13), stacked(w2)
    for num_tokens in (1, 5, 17):  # one token, fewer than a block, a second block for the busiest expert
        x, _, _, weights, ids = random_moe(num_tokens, num_experts, hidden, intermediate, top_k, seed=num_tokens)
        expected = grouped_experts(x, dequantized(w13), dequantized(w2), weights, ids)
        out = fused_experts(x.to(dtype), packed13, packed2, weights.to(dtype), ids, silu_and_mul)
        assert out.dtype == dtype and relative_error(out, expected) < QUANT_TOLERANCE[dtype], (num_tokens, dtype)


def test_cuda_platform_stacks_quantized_experts_once_and_runs_them_fused():
    # the CUDA platform's load and forward on CPU tensors: pack_quantized_experts, then moe_experts
    w13, w2 = random_quantized_experts(4, 64, 32, 4, 32, True)
    packed13, packed2 = cuda.pack_quantized_experts(w13, w2, torch.bfloat16)
    assert type(packed13) is QuantizedExperts and packed13.qweight.shape == (4, 64, 32)  # int4: two columns a byte
    assert type(packed2) is QuantizedExperts and packed2.scales.shape == (4, 64, 1)  # 32 columns: one group
    x, _, _, weights, ids = random_moe(7, 4, 64, 32, 2, seed=11)
    expected = grouped_experts(x, dequantized(w13), dequantized(w2), weights, ids)
    out = cuda.moe_experts(x.bfloat16(), packed13, packed2, weights.bfloat16(), ids, silu_and_mul)
    assert relative_error(out, expected) < QUANT_TOLERANCE[torch.bfloat16]


def test_w8a8_experts_stay_grouped_by_expert_with_a_log_line(caplog):
    w13, w2 = random_quantized_experts(4, 64, 32, 8, None, False, activation="int8")
    cuda._log_grouped_experts.cache_clear()  # logged once a process: an earlier load may have logged it
    with caplog.at_level(logging.INFO, logger="tpengine"):
        packed13, packed2 = cuda.pack_quantized_experts(w13, w2, torch.float32)
    assert all(isinstance(p, QuantMatmulWeight) for p in packed13 + packed2)
    assert "W8A8 experts" in caplog.text
    x, _, _, weights, ids = random_moe(3, 4, 64, 32, 2, seed=12)
    expected = grouped_experts(x, dequantized(w13), dequantized(w2), weights, ids)
    # activations quantized per token to int8: about 1% of the largest output
    assert relative_error(cuda.moe_experts(x, packed13, packed2, weights, ids, silu_and_mul), expected) < 3e-2
