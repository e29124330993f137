"""Fused mixture-of-experts for the GPU: tokens sorted and padded into per-expert blocks, then one grouped
GEMM for gate/up and one for down, the routing weight applied in the second.

Each (token, k) pair of the routing is one row. The rows are sorted by expert and each expert's run is
padded to a multiple of BLOCK_M, so every program's BLOCK_M rows share one expert's weights; experts
no token chose get no block at all (the few spare blocks a fixed grid needs return at once).
"""
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from tpengine.kernels.triton.paged_attention_tile import _dot, dot_block

BLOCK_M = 16
# Triton's CUDA defaults, named so that COMPILE_CASES compiles what the launcher runs
NUM_WARPS = 4
NUM_STAGES = 3


@triton.jit
def _grouped_gemm_kernel(
    a,               # [rows of A, K]
    b,               # [experts, N, K]: each expert's weight, as nn.Linear stores it
    c,               # [pairs, N]
    pair_weights,    # [pairs] routing weights (read with MUL_WEIGHT)
    sorted_pairs,    # [padded rows] pair ids grouped by expert; padding holds num_pairs
    block_experts,   # [blocks] the expert of each BLOCK_M rows
    num_pairs, num_experts, N, K,
    stride_am, stride_be, stride_bn, stride_cm,
    PAIRS_PER_A_ROW: tl.constexpr,  # top_k when A holds tokens, 1 when it holds pairs
    MUL_WEIGHT: tl.constexpr,
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
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(a + a_rows[:, None] * stride_am + offs_k[None, :],
                    mask=valid[:, None] & (offs_k[None, :] < K), other=0.0)
        w = tl.load(b + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None],
                    mask=(offs_n[None, :] < N) & (offs_k[:, None] < K), other=0.0)
        acc += _dot(x, w)
    if MUL_WEIGHT:
        acc = acc * tl.load(pair_weights + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(c + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :], acc.to(c.dtype.element_ty),
             mask=valid[:, None] & (offs_n[None, :] < N))


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
    n, k = weights.shape[1], weights.shape[2]
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    constexprs = _constexprs(n, k, pairs_per_a_row, mul_weight)
    grid = (block_experts.numel(), triton.cdiv(n, constexprs["BLOCK_N"]))
    _grouped_gemm_kernel[grid](
        a, weights, out, pair_weights, sorted_pairs, block_experts, num_pairs, weights.size(0), n, k,
        a.stride(0), weights.stride(0), weights.stride(1), out.stride(0),
        **constexprs, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out


def _constexprs(n: int, k: int, pairs_per_a_row: int, mul_weight: bool) -> dict:
    """The kernel's compile-time arguments for an [N, K] weight: what the launcher passes and COMPILE_CASES compile.
    The token count picks none of them: it only sizes the grid."""
    return dict(PAIRS_PER_A_ROW=pairs_per_a_row, MUL_WEIGHT=mul_weight, BLOCK_M=BLOCK_M,
                BLOCK_N=min(dot_block(n), 64), BLOCK_K=min(dot_block(k), 64))


def _compile_case(name: str, dtype: str, n: int, k: int, pairs_per_a_row: int, mul_weight: bool) -> dict:
    """One COMPILE_CASES entry (scripts/compile_triton_kernels.py): the kernel as the launcher calls it."""
    ints = ["num_pairs", "num_experts", "N", "K", "stride_am", "stride_be", "stride_bn", "stride_cm"]
    signature = {"a": f"*{dtype}", "b": f"*{dtype}", "c": f"*{dtype}", "pair_weights": f"*{dtype}",
                 "sorted_pairs": "*i64", "block_experts": "*i64", **dict.fromkeys(ints, "i32")}
    constexprs = _constexprs(n, k, pairs_per_a_row, mul_weight)
    return {"kernel": _grouped_gemm_kernel, "signature": {**signature, **dict.fromkeys(constexprs, "constexpr")},
            "constexprs": constexprs, "num_warps": NUM_WARPS, "num_stages": NUM_STAGES, "name": name}


# fused_experts' two GEMMs at Qwen3-30B-A3B's shape (hidden 2048, 768 per expert, top 8), one in each model dtype: every
# real weight is at least 64 wide, so the tiles are 16 x 64 x 64 at any token count.
COMPILE_CASES = [
    _compile_case("gate/up: top 8, bf16, 1536 x 2048", "bf16", 1536, 2048, 8, False),
    _compile_case("down: routing weight, fp16, 2048 x 768", "fp16", 2048, 768, 1, True),
]


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, act_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """sum over each token's chosen experts of weight * down(act_and_mul(gate_up(x))); x [tokens, hidden],
    w13 [experts, 2 * intermediate, hidden] (gate then up), w2 [experts, hidden, intermediate]. act_and_mul,
    the layer's (silu(gate) * up), runs between the two GEMMs."""
    assert x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1, "rows must be contiguous"
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    sorted_pairs, block_experts = align_pairs_to_blocks(topk_ids, w13.size(0))
    gate_up = _grouped_gemm(x, w13, topk_weights, sorted_pairs, block_experts, num_pairs, top_k, False)
    down = _grouped_gemm(act_and_mul(gate_up), w2, topk_weights.flatten().contiguous(), sorted_pairs,
                         block_experts, num_pairs, 1, True)
    return down.view(num_tokens, top_k, -1).sum(dim=1)
