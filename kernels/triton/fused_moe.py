"""Fused mixture-of-experts for the GPU: tokens sorted and padded into per-expert blocks, then one grouped
GEMM for gate/up and one for down, the routing weight applied in the second.

Each (token, k) pair of the routing is one row. The rows are sorted by expert and each expert's run is
padded to a multiple of BLOCK_M, so every program's BLOCK_M rows share one expert's weights; experts
no token chose get no block at all (the few spare blocks a fixed grid needs return at once).

Quantized experts (int4/int8 weight-only: GPTQ, AWQ, compressed-tensors W4A16/W8A16, quantization="int4"/"int8")
run through the same GEMMs on their packs stacked (QuantizedExperts): quant_matmul's layout with an expert
dimension, unpacked in registers by quant_matmul's tile helpers. W8A8 experts (int8 activations) and act-order
ones are not taken here (stack_quantized_experts says why): the platform runs them grouped by expert in torch.
"""
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tpengine.kernels.triton.paged_attention_tile import _dot, dot_block
from tpengine.kernels.triton.quant_matmul import QuantMatmulWeight, _scaled_block_product, _stored_weight_tile

BLOCK_M = 16
# Triton's CUDA defaults, named so that COMPILE_CASES compiles what the launcher runs
NUM_WARPS = 4
NUM_STAGES = 3


class QuantizedExperts(NamedTuple):
    """The experts' int4/int8 weights, each a QuantMatmulWeight (activation "float", no act order), stacked:
    w[e, n, k] = scales[e, n, g] * (q[e, n, k] - zeros[e, n, g]), g = k // group_size."""
    qweight: torch.Tensor  # int4: uint8 [experts, N, K / 2] (q + 8, column 2j in byte j's low nibble); int8 [.., K]
    scales: torch.Tensor  # float32 [experts, N, groups]
    zeros: torch.Tensor | None  # float32 [experts, N, groups] on the stored values' scale; None: 0
    bits: int
    group_size: int  # columns per group; K for one group per output channel

    @property
    def num_experts(self) -> int:
        return self.qweight.size(0)

    @property
    def out_features(self) -> int:
        return self.qweight.size(1)

    @property
    def packed_columns(self) -> int:
        return self.qweight.size(2) * (2 if self.bits == 4 else 1)


def stack_quantized_experts(weights: list[QuantMatmulWeight]) -> QuantizedExperts:
    """One projection's packs, one per expert, stacked once at load; ValueError naming what the fused kernel does
    not take (the platform then runs them grouped by expert)."""
    first = weights[0]
    if any(w.activation != "float" for w in weights):
        raise ValueError("W8A8 experts (int8 activations): the fused kernel multiplies float activations only")
    if any(w.input_order is not None for w in weights):
        raise ValueError("act-order experts (g_idx): the fused kernel reads each expert's columns in order")
    layout = (first.bits, first.group_size, first.qweight.shape, first.scales.shape, first.zeros is None)
    if any((w.bits, w.group_size, w.qweight.shape, w.scales.shape, w.zeros is None) != layout for w in weights):
        raise ValueError("the experts of one projection are quantized differently: one launch takes one layout")
    zeros = None if first.zeros is None else torch.stack([w.zeros for w in weights])
    return QuantizedExperts(torch.stack([w.qweight for w in weights]), torch.stack([w.scales for w in weights]),
                            zeros, first.bits, first.group_size)


@triton.jit
def _grouped_gemm_kernel(
    a,               # [rows of A, K]
    b,               # [experts, N, K]: each expert's weight, as nn.Linear stores it; BITS: QuantizedExperts.qweight
    c,               # [pairs, N]
    pair_weights,    # [pairs] routing weights (read with MUL_WEIGHT)
    sorted_pairs,    # [padded rows] pair ids grouped by expert; padding holds num_pairs
    block_experts,   # [blocks] the expert of each BLOCK_M rows
    scales,          # float32 [experts, N, groups] (read with BITS)
    zeros,           # float32 [experts, N, groups] (read with HAS_ZEROS)
    num_pairs, num_experts, N, K, group_size,
    stride_am, stride_be, stride_bn, stride_cm, stride_se, stride_sn,
    PAIRS_PER_A_ROW: tl.constexpr,  # top_k when A holds tokens, 1 when it holds pairs
    MUL_WEIGHT: tl.constexpr,
    BITS: tl.constexpr,  # 0: float weights; 4 or 8: quantized, unpacked in registers
    HAS_ZEROS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_experts + pid_m).to(tl.int64)
    if expert >= num_experts:  # a spare block past the last expert's
        return
    pairs = tl.load(sorted_pairs + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    a_rows = (pairs // PAIRS_PER_A_ROW).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_rows = b + expert * stride_be + offs_n.to(tl.int64)[:, None] * stride_bn
    expert_scales = scales + expert * stride_se
    expert_zeros = zeros + expert * stride_se
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(a + a_rows[:, None] * stride_am + offs_k[None, :], mask=valid[:, None] & k_mask[None, :],
                    other=0.0)
        if BITS == 0:
            w = tl.load(b + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None],
                        mask=n_mask[None, :] & k_mask[:, None], other=0.0)
            acc += _dot(x, w)
        else:  # a K block lies in one group (_constexprs): its product scaled once, as quant_matmul does
            q = _stored_weight_tile(w_rows, k0, offs_k, n_mask, k_mask, K, BITS, BLOCK_K)
            acc += _scaled_block_product(x, q, expert_scales, expert_zeros, offs_n * stride_sn + k0 // group_size,
                                         n_mask, BITS, HAS_ZEROS)
    if MUL_WEIGHT:
        acc = acc * tl.load(pair_weights + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(c + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :], acc.to(c.dtype.element_ty),
             mask=valid[:, None] & n_mask[None, :])


def align_pairs_to_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M):
    """(sorted_pairs [max blocks * block_m], block_experts [max blocks]): pair ids grouped by expert, each
    expert's run padded to whole blocks with the out-of-range id topk_ids.numel(); blocks past the last
    expert's get expert id num_experts and do nothing.

    Every shape depends only on the number of pairs (never on the routing), and nothing waits for the
    device, so a CUDA graph can capture it.
    """
    flat = topk_ids.flatten()
    num_pairs, device = flat.numel(), flat.device
    max_blocks = triton.cdiv(num_pairs, block_m) + num_experts - 1  # each expert wastes less than a block
    order = flat.argsort(stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    blocks_per_expert = (counts + block_m - 1) // block_m
    block_ends = torch.cumsum(blocks_per_expert, 0)
    block_experts = torch.searchsorted(block_ends, torch.arange(max_blocks, device=device), right=True)
    # where each expert's run starts among the sorted pairs, and among the padded rows
    pair_starts = torch.cumsum(counts, 0) - counts
    row_starts = (block_ends - blocks_per_expert) * block_m
    sorted_experts = flat[order]
    rows = row_starts[sorted_experts] + torch.arange(num_pairs, device=device) - pair_starts[sorted_experts]
    sorted_pairs = torch.full((max_blocks * block_m,), num_pairs, dtype=torch.int64, device=device)
    sorted_pairs[rows] = order
    return sorted_pairs, block_experts


def _grouped_gemm(a, weights, pair_weights, sorted_pairs, block_experts, num_pairs, pairs_per_a_row, mul_weight):
    if isinstance(weights, QuantizedExperts):
        b, n, k, num_experts = weights.qweight, weights.out_features, weights.packed_columns, weights.num_experts
        scales, bits, group_size = weights.scales, weights.bits, weights.group_size
        has_zeros = weights.zeros is not None
        zeros = weights.zeros if has_zeros else scales  # a stand-in, never read
        assert zeros.stride() == scales.stride(), "zeros are indexed with the scales' strides"
        stride_se, stride_sn = scales.stride(0), scales.stride(1)
    else:  # float weights: the scale arguments are stand-ins, never read
        b, (num_experts, n, k) = weights, weights.shape
        scales = zeros = pair_weights
        bits, group_size, has_zeros, stride_se, stride_sn = 0, k, False, 0, 0
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    constexprs = _constexprs(n, k, pairs_per_a_row, mul_weight, bits, group_size, has_zeros)
    grid = (block_experts.numel(), triton.cdiv(n, constexprs["BLOCK_N"]))
    _grouped_gemm_kernel[grid](
        a, b, out, pair_weights, sorted_pairs, block_experts, scales, zeros, num_pairs, num_experts, n, k, group_size,
        a.stride(0), b.stride(0), b.stride(1), out.stride(0), stride_se, stride_sn,
        **constexprs, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out


def _constexprs(n: int, k: int, pairs_per_a_row: int, mul_weight: bool, bits: int = 0, group_size: int | None = None,
                has_zeros: bool = False) -> dict:
    """The kernel's compile-time arguments for an [N, K] weight (bits 0: float; 4 or 8: quantized in groups of
    group_size columns, None: one per output channel): what the launcher passes and COMPILE_CASES compile.
    The token count picks none of them: it only sizes the grid."""
    block_k = min(dot_block(k), 64)
    if bits and group_size is not None and group_size < k:  # a K block must not cross a group's end
        block_k = min(block_k, group_size & -group_size)
    return dict(PAIRS_PER_A_ROW=pairs_per_a_row, MUL_WEIGHT=mul_weight, BITS=bits, HAS_ZEROS=has_zeros,
                BLOCK_M=BLOCK_M, BLOCK_N=min(dot_block(n), 64), BLOCK_K=block_k)


def _compile_case(name: str, dtype: str, n: int, k: int, pairs_per_a_row: int, mul_weight: bool, bits: int = 0,
                  group_size: int | None = None, has_zeros: bool = False) -> dict:
    """One COMPILE_CASES entry (tools/compile_triton_kernels.py): the kernel as the launcher calls it."""
    ints = ["num_pairs", "num_experts", "N", "K", "group_size", "stride_am", "stride_be", "stride_bn", "stride_cm",
            "stride_se", "stride_sn"]
    scale_type = "*fp32" if bits else f"*{dtype}"  # float weights: pair_weights stands in for the scales
    signature = {"a": f"*{dtype}", "b": {0: f"*{dtype}", 4: "*u8", 8: "*i8"}[bits], "c": f"*{dtype}",
                 "pair_weights": f"*{dtype}", "sorted_pairs": "*i64", "block_experts": "*i64", "scales": scale_type,
                 "zeros": scale_type, **dict.fromkeys(ints, "i32")}
    constexprs = _constexprs(n, k, pairs_per_a_row, mul_weight, bits, group_size, has_zeros)
    return {"kernel": _grouped_gemm_kernel, "signature": {**signature, **dict.fromkeys(constexprs, "constexpr")},
            "constexprs": constexprs, "num_warps": NUM_WARPS, "num_stages": NUM_STAGES, "name": name}


# fused_experts' two GEMMs at Qwen3-30B-A3B's shape (hidden 2048, 768 per expert, top 8), one in each model dtype: every
# real weight is at least 64 wide, so the tiles are 16 x 64 x 64 at any token count. Quantized experts, bfloat16
# only (each case costs the test suite seconds): AWQ/GPTQ int4 groups of 128 with zero points, W8A16 per channel.
COMPILE_CASES = [
    _compile_case("gate/up: top 8, bf16, 1536 x 2048", "bf16", 1536, 2048, 8, False),
    _compile_case("down: routing weight, fp16, 2048 x 768", "fp16", 2048, 768, 1, True),
    _compile_case("gate/up: int4 g128+zeros, top 8, bf16, 1536 x 2048", "bf16", 1536, 2048, 8, False, 4, 128, True),
    _compile_case("down: int8 per-channel, routing weight, bf16, 2048 x 768", "bf16", 2048, 768, 1, True, 8),
]


def fused_experts(x: torch.Tensor, w13: torch.Tensor | QuantizedExperts, w2: torch.Tensor | QuantizedExperts,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  act_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """sum over each token's chosen experts of weight * down(act_and_mul(gate_up(x))); x [tokens, hidden],
    w13 [experts, 2 * intermediate, hidden] (gate then up), w2 [experts, hidden, intermediate], float tensors or
    each a QuantizedExperts of that shape. act_and_mul, the layer's (silu(gate) * up), runs between the GEMMs."""
    quantized = isinstance(w13, QuantizedExperts)
    assert quantized == isinstance(w2, QuantizedExperts), "both projections quantized, or neither"
    assert x.stride(1) == 1 and (quantized or (w13.stride(2) == 1 and w2.stride(2) == 1)), "rows must be contiguous"
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    sorted_pairs, block_experts = align_pairs_to_blocks(topk_ids, w13.num_experts if quantized else w13.size(0))
    gate_up = _grouped_gemm(x, w13, topk_weights, sorted_pairs, block_experts, num_pairs, top_k, False)
    down = _grouped_gemm(act_and_mul(gate_up), w2, topk_weights.flatten().contiguous(), sorted_pairs,
                         block_experts, num_pairs, 1, True)
    return down.view(num_tokens, top_k, -1).sum(dim=1)
