"""Varlen causal prefill attention with all keys read from the paged KV cache.

Each sequence's new queries are the last seqlen_q of its seqlen_k keys, so a cached
prefix (prefix-cache hit or earlier chunk of a chunked prefill) is attended to as well.
Optional per-row key ends let a query see keys past its own position (Gemma 3's
bidirectional attention within an image).
"""

import torch
import triton
import triton.language as tl

from .paged_attention_tile import (ATTENTION_COMPILE_SHAPES, LOG2E, attend_paged_kv_tile, attention_compile_case,
                                   dot_block)

BLOCK_M = 64
BLOCK_N = 64
# Triton's CUDA defaults, named so that COMPILE_CASES compiles what the launcher runs
NUM_WARPS = 4
NUM_STAGES = 3


@triton.jit
def _paged_prefill_kernel(
    out,
    q,
    k_cache,
    v_cache,
    cu_seqlens_q,
    cu_seqlens_k,
    block_tables,
    key_ends,  # HAS_KEY_ENDS: int32 [total_q], each row's exclusive end of visible keys (unread otherwise)
    sinks,
    k_scale,  # FP8 cache: pointers to the layer's float32 scales (unread otherwise)
    v_scale,
    qk_scale,
    window,
    softcap,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_block,
    stride_slot,
    stride_kv_head,
    HEAD_DIM: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    FP8_KV: tl.constexpr,
    HAS_KEY_ENDS: tl.constexpr,
):
    # One program per (query tile, sequence, query head).
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q + seq)
    seqlen_q = tl.load(cu_seqlens_q + seq + 1) - q_start
    start_m = tile * BLOCK_M
    # The grid is sized for the longest sequence; shorter ones have nothing to do here.
    if start_m >= seqlen_q:
        return
    seqlen_k = tl.load(cu_seqlens_k + seq + 1) - tl.load(cu_seqlens_k + seq)
    prefix_len = seqlen_k - seqlen_q

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    qo_mask = (offs_m < seqlen_q)[:, None] & d_mask[None, :]
    q_tile = tl.load(
        q + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=qo_mask, other=0.0
    )

    if HAS_SINKS:  # the sink is the softmax's first term: exp2(sink - m_i) = 1, and no value
        m_i = tl.zeros([BLOCK_M], tl.float32) + tl.load(sinks + head).to(tl.float32) * LOG2E
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    row_limit, kv_end = _row_key_ends(key_ends + q_start, offs_m, start_m, seqlen_q, prefix_len, seqlen_k,
                                      BLOCK_M, HAS_KEY_ENDS)
    # a sliding window: query i sees keys from prefix_len + i - window + 1; the tile's first row sees the earliest
    span = tl.where(window > 0, window, seqlen_k)  # no window: one that reaches key 0 from every row
    row_start = tl.maximum(prefix_len + offs_m - span + 1, 0)
    kv_start = tl.maximum(prefix_len + start_m - span + 1, 0)
    for start_n in range(kv_start - kv_start % BLOCK_N, kv_end, BLOCK_N):
        acc, m_i, l_i = attend_paged_kv_tile(
            acc, m_i, l_i, q_tile, k_cache, v_cache, k_scale, v_scale,
            block_tables + seq * stride_bt, (head // GROUP_SIZE) * stride_kv_head, stride_block, stride_slot,
            start_n, seqlen_k, row_limit, row_start, qk_scale, softcap, offs_d, d_mask,
            BLOCK_SIZE, BLOCK_N, FP8_KV,
        )

    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # padding rows may see no key
    o_ptrs = out + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, acc.to(out.dtype.element_ty), mask=qo_mask)


@triton.jit
def _row_key_ends(row_key_ends, offs_m, start_m, seqlen_q, prefix_len, seqlen_k, BLOCK_M: tl.constexpr,
                  HAS_KEY_ENDS: tl.constexpr):
    """(row_limit [M]: each row sees keys < it, kv_end: the tile's last key + 1) for query rows offs_m."""
    if HAS_KEY_ENDS:  # rows in an image see its later keys too, so the tile may reach past its diagonal
        row_limit = tl.load(row_key_ends + offs_m, mask=offs_m < seqlen_q, other=0)  # padding rows see nothing
        row_limit = tl.minimum(row_limit, seqlen_k)
        kv_end = tl.max(row_limit, axis=0)
    else:  # causal: query i sees keys [0, prefix_len + i]; clamp so padding rows stay in range
        row_limit = tl.minimum(prefix_len + offs_m + 1, seqlen_k)
        kv_end = tl.minimum(prefix_len + start_m + BLOCK_M, seqlen_k)
    return row_limit, kv_end


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seqlen_q: int,
    *,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    key_ends: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over all its cached keys.

    q: [total_q, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim];
    cu_seqlens_q, cu_seqlens_k: int32 [batch + 1]; block_tables: int32 [batch, max_num_blocks].
    Query i of sequence b attends to keys [0, seqlen_k - seqlen_q + i], only the last `window` of them when
    window > 0; softcap, sinks and an FP8 cache's k_scale, v_scale as in paged_decode_attention.
    key_ends: int32 [total_q], optional: query row r at position p instead sees keys [0, key_ends[r]), with
    p + 1 <= key_ends[r] <= seqlen_k (bidirectional within an image); a window still hides keys <= p - window.
    Returns [total_q, num_heads, head_dim].
    """
    total_q, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    batch = cu_seqlens_q.shape[0] - 1
    assert num_heads % num_kv_heads == 0
    assert q.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    fp8_kv = k_cache.dtype == torch.float8_e4m3fn
    assert k_cache.dtype == v_cache.dtype and (fp8_kv or q.dtype == k_cache.dtype)
    assert not fp8_kv or (k_scale is not None and v_scale is not None)
    assert key_ends is None or (key_ends.dtype == torch.int32 and key_ends.shape == (total_q,))

    out = torch.empty((total_q, num_heads, head_dim), dtype=q.dtype, device=q.device)
    grid = (triton.cdiv(max_seqlen_q, BLOCK_M), batch, num_heads)
    _paged_prefill_kernel[grid](
        out, q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, block_tables,
        key_ends if key_ends is not None else cu_seqlens_q, sinks if sinks is not None else q,
        k_scale if fp8_kv else q, v_scale if fp8_kv else q, scale * LOG2E.value, window, softcap,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        **_constexprs(head_dim, num_heads // num_kv_heads, block_size, sinks is not None, fp8_kv,
                      key_ends is not None),
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    return out


def _constexprs(head_dim: int, group_size: int, block_size: int, has_sinks: bool, fp8_kv: bool,
                has_key_ends: bool) -> dict:
    """The kernel's compile-time arguments for one model shape: what the launcher passes and COMPILE_CASES compile."""
    return dict(HEAD_DIM=head_dim, GROUP_SIZE=group_size, BLOCK_SIZE=block_size, BLOCK_M=BLOCK_M,
                BLOCK_D=dot_block(head_dim), BLOCK_N=BLOCK_N, HAS_SINKS=has_sinks, FP8_KV=fp8_kv,
                HAS_KEY_ENDS=has_key_ends)


def _compile_case(name: str, dtype: str, head_dim: int, group_size: int, block_size: int, has_sinks: bool,
                  fp8_kv: bool = False, has_key_ends: bool = False) -> dict:
    """One COMPILE_CASES entry: the kernel as the launcher calls it."""
    strides = ["stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_bt", "stride_block", "stride_slot",
               "stride_kv_head"]
    index_args = ["cu_seqlens_q", "cu_seqlens_k", "block_tables", "key_ends"]
    return attention_compile_case(_paged_prefill_kernel, name, dtype, index_args, strides,
                                  _constexprs(head_dim, group_size, block_size, has_sinks, fp8_kv, has_key_ends),
                                  NUM_WARPS, NUM_STAGES)


# Gemma 3 (head_dim 256, bf16, no sinks) with images: the largest tiles, walking key tiles past the diagonal
COMPILE_CASES = [*(_compile_case(*shape) for shape in ATTENTION_COMPILE_SHAPES),
                 _compile_case("head_dim 256, group 2, bf16, block 256, key ends", "bf16", 256, 2, 256, False,
                               has_key_ends=True)]
