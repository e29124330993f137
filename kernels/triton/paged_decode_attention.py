"""Decode attention: one new query per sequence against its paged KV cache."""

import torch
import triton
import triton.language as tl

from .paged_attention_tile import (ATTENTION_COMPILE_SHAPES, LOG2E, attend_paged_kv_tile, attention_compile_case,
                                   dot_block)

BLOCK_N = 64
# Triton's CUDA defaults, named so that COMPILE_CASES compiles what the launcher runs
NUM_WARPS = 4
NUM_STAGES = 3


@triton.jit
def _paged_decode_kernel(
    out,
    q,
    k_cache,
    v_cache,
    block_tables,
    context_lens,
    sinks,
    k_scale,  # FP8 cache: pointers to the layer's float32 scales (unread otherwise)
    v_scale,
    qk_scale,
    window,
    softcap,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_bt,
    stride_block,
    stride_slot,
    stride_kv_head,
    HEAD_DIM: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    FP8_KV: tl.constexpr,
):
    # One program per (sequence, kv head): the group's query heads share each K/V tile load.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    kv_len = tl.load(context_lens + seq)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP_SIZE + offs_g
    qo_mask = (offs_g < GROUP_SIZE)[:, None] & d_mask[None, :]
    q_tile = tl.load(q + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=qo_mask, other=0.0)

    if HAS_SINKS:  # the sink is the softmax's first term: exp2(sink - m_i) = 1, and no value
        m_i = tl.load(sinks + heads, mask=offs_g < GROUP_SIZE, other=0.0).to(tl.float32) * LOG2E
        l_i = tl.full([BLOCK_G], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    row_limit = tl.zeros([BLOCK_G], tl.int32) + kv_len
    # a sliding window: keys before kv_len - window are never read (the loop starts at their tile)
    first_key = tl.maximum(kv_len - tl.where(window > 0, window, kv_len), 0)
    row_start = tl.zeros([BLOCK_G], tl.int32) + first_key
    for start_n in range(first_key - first_key % BLOCK_N, kv_len, BLOCK_N):
        acc, m_i, l_i = attend_paged_kv_tile(
            acc, m_i, l_i, q_tile, k_cache, v_cache, k_scale, v_scale,
            block_tables + seq * stride_bt, kv_head * stride_kv_head, stride_block, stride_slot,
            start_n, kv_len, row_limit, row_start, qk_scale, softcap, offs_d, d_mask,
            BLOCK_SIZE, BLOCK_N, FP8_KV,
        )

    # An empty context (a padded batch slot) has l_i == 0: emit zeros instead of NaN.
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = out + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, acc.to(out.dtype.element_ty), mask=qo_mask)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query per sequence over its first context_lens[b] cached tokens.

    q: [batch, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim];
    block_tables: int32 [batch, max_num_blocks]; context_lens: int32 [batch].
    window > 0: only the last `window` of them (the blocks before are never read); softcap > 0: scores become
    softcap * tanh(scores / softcap); sinks: [num_heads] logits, one more softmax term each, with no value.
    An FP8 (e4m3) cache is read as float32(fp8) * scale in q's dtype, k_scale and v_scale float32 of one element.
    Returns [batch, num_heads, head_dim] in q's dtype (zeros where context_lens[b] == 0).
    """
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0
    assert q.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    fp8_kv = k_cache.dtype == torch.float8_e4m3fn
    assert k_cache.dtype == v_cache.dtype and (fp8_kv or q.dtype == k_cache.dtype)
    assert not fp8_kv or (k_scale is not None and v_scale is not None)
    group_size = num_heads // num_kv_heads

    out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    _paged_decode_kernel[(batch, num_kv_heads)](
        out, q, k_cache, v_cache, block_tables, context_lens, sinks if sinks is not None else q,
        k_scale if fp8_kv else q, v_scale if fp8_kv else q, scale * LOG2E.value, window, softcap,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        **_constexprs(head_dim, group_size, block_size, sinks is not None, fp8_kv),
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    return out


def _constexprs(head_dim: int, group_size: int, block_size: int, has_sinks: bool, fp8_kv: bool) -> dict:
    """The kernel's compile-time arguments for one model shape: what the launcher passes and COMPILE_CASES compile."""
    return dict(HEAD_DIM=head_dim, GROUP_SIZE=group_size, BLOCK_SIZE=block_size, BLOCK_G=dot_block(group_size),
                BLOCK_D=dot_block(head_dim), BLOCK_N=BLOCK_N, HAS_SINKS=has_sinks, FP8_KV=fp8_kv)


def _compile_case(name: str, dtype: str, head_dim: int, group_size: int, block_size: int, has_sinks: bool,
                  fp8_kv: bool = False) -> dict:
    """One COMPILE_CASES entry: the kernel as the launcher calls it."""
    strides = ["stride_qb", "stride_qh", "stride_ob", "stride_oh", "stride_bt", "stride_block", "stride_slot",
               "stride_kv_head"]
    return attention_compile_case(_paged_decode_kernel, name, dtype, ["block_tables", "context_lens"], strides,
                                  _constexprs(head_dim, group_size, block_size, has_sinks, fp8_kv), NUM_WARPS,
                                  NUM_STAGES)


COMPILE_CASES = [_compile_case(*shape) for shape in ATTENTION_COMPILE_SHAPES]
