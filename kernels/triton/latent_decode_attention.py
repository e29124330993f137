"""Decode attention over a latent paged cache (DeepSeek's multi-head latent attention, absorbed).

Each cached token is one vector, [latent (LATENT_DIM), rotary key (ROPE_DIM)], shared by every head; each head's
query is [q_nope W_uk, q_pe] and its output the softmax-weighted sum of the latents (W_uv is applied after). The
generic paged decode kernel runs one program per sequence for a single KV head, reading every vector twice (as key
and value): here a program takes BLOCK_H heads of one sequence and one split of its keys (flash-decoding), reads each
tile of vectors once for both products, and a second kernel joins the splits by their log-sum-exp.
"""
import torch
import triton
import triton.language as tl

from .paged_attention_tile import LOG2E, _dot, dot_block, fold_tile

BLOCK_N = 32
BLOCK_H = 16  # heads per program: the MMA minimum
MAX_SPLITS = 16
MIN_KEYS_PER_SPLIT = 256  # a short context is not worth splitting
NUM_WARPS = 4
NUM_STAGES = 2


@triton.jit
def _latent_decode_kernel(
    partial_out,  # [batch, heads, splits, LATENT_DIM] fp32
    partial_lse,  # [batch, heads, splits] fp32 (log2 domain)
    q,
    cache,
    block_tables,
    context_lens,
    qk_scale,
    num_heads,
    keys_per_split,
    stride_qb,
    stride_qh,
    stride_bt,
    stride_block,
    stride_slot,
    LATENT_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    seq = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    kv_len = tl.load(context_lens + seq)
    first = split * keys_per_split
    last = tl.minimum(first + keys_per_split, kv_len)

    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    h_mask = heads < num_heads
    l_mask = offs_l < LATENT_DIM
    r_mask = offs_r < ROPE_DIM
    q_row = q + seq * stride_qb + heads[:, None] * stride_qh
    q_latent = tl.load(q_row + offs_l[None, :], mask=h_mask[:, None] & l_mask[None, :], other=0.0)
    q_rope = tl.load(q_row + LATENT_DIM + offs_r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    table = block_tables + seq * stride_bt
    for start_n in range(first, last, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < last
        block = tl.load(table + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        row = cache + block * stride_block + (offs_n % BLOCK_SIZE) * stride_slot
        latent = tl.load(row[:, None] + offs_l[None, :], mask=n_mask[:, None] & l_mask[None, :], other=0.0)
        rope = tl.load(row[:, None] + LATENT_DIM + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :],
                       other=0.0)
        s = (_dot(q_latent, tl.trans(latent)) + _dot(q_rope, tl.trans(rope))) * qk_scale
        acc, m_i, l_i = fold_tile(acc, m_i, l_i, tl.where(n_mask[None, :], s, float("-inf")), latent)

    # a split with no keys (past the context) has l_i == 0: its lse is -inf, and the join gives it no weight
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
    part = (seq * num_heads + heads) * NUM_SPLITS + split
    tl.store(partial_out + part[:, None] * LATENT_DIM + offs_l[None, :], out, mask=h_mask[:, None] & l_mask[None, :])
    tl.store(partial_lse + part, lse, mask=h_mask)


@triton.jit
def _join_splits_kernel(
    out,  # [batch, heads, LATENT_DIM] in q's dtype
    partial_out,
    partial_lse,
    stride_ob,
    stride_oh,
    num_heads,
    LATENT_DIM: tl.constexpr,
    BLOCK_L: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_l = tl.arange(0, BLOCK_L)
    s_mask = offs_s < NUM_SPLITS
    l_mask = offs_l < LATENT_DIM
    base = (seq * num_heads + head) * NUM_SPLITS
    lse = tl.load(partial_lse + base + offs_s, mask=s_mask, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)  # an empty context: every weight 0, the output 0
    weight = tl.exp2(lse - top)
    parts = tl.load(partial_out + (base + offs_s)[:, None] * LATENT_DIM + offs_l[None, :],
                    mask=s_mask[:, None] & l_mask[None, :], other=0.0)
    total = tl.sum(weight, axis=0)
    joined = tl.sum(parts * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out + seq * stride_ob + head * stride_oh + offs_l, joined.to(out.dtype.element_ty), mask=l_mask)


def num_splits_for(max_context: int) -> int:
    """Splits of each sequence's keys: enough programs for a small batch, none too short to pay."""
    return max(1, min(MAX_SPLITS, max_context // MIN_KEYS_PER_SPLIT))


def latent_decode_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                            context_lens: torch.Tensor, scale: float, latent_dim: int,
                            num_splits: int | None = None) -> torch.Tensor:
    """q: [batch, heads, latent_dim + rope_dim] (absorbed queries); cache: [num_blocks, block_size, 1, latent_dim +
    rope_dim]; block_tables int32 [batch, max_num_blocks]; context_lens int32 [batch]. Returns [batch, heads,
    latent_dim] in q's dtype: each head's softmax(scale * q . cache) over the latents (zeros where context_lens[b]
    == 0). num_splits: each sequence's keys in that many parts run apart; by default num_splits_for the block
    table's width, which a captured CUDA graph keeps."""
    batch, num_heads, width = q.shape
    _, block_size, num_kv_heads, cache_width = cache.shape
    assert num_kv_heads == 1 and cache_width == width and q.stride(-1) == 1 and cache.is_contiguous()
    assert q.dtype == cache.dtype
    rope_dim = width - latent_dim
    max_keys = block_tables.size(1) * block_size
    num_splits = num_splits or num_splits_for(max_keys)
    keys_per_split = triton.cdiv(triton.cdiv(max_keys, num_splits), BLOCK_N) * BLOCK_N
    partial_out = torch.empty((batch, num_heads, num_splits, latent_dim), dtype=torch.float32, device=q.device)
    partial_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    _latent_decode_kernel[(batch, triton.cdiv(num_heads, BLOCK_H), num_splits)](
        partial_out, partial_lse, q, cache, block_tables, context_lens, scale * LOG2E.value, num_heads,
        keys_per_split, q.stride(0), q.stride(1), block_tables.stride(0), cache.stride(0), cache.stride(1),
        **_decode_constexprs(latent_dim, rope_dim, block_size, num_splits), num_warps=NUM_WARPS,
        num_stages=NUM_STAGES)
    out = torch.empty((batch, num_heads, latent_dim), dtype=q.dtype, device=q.device)
    _join_splits_kernel[(batch, num_heads)](out, partial_out, partial_lse, out.stride(0), out.stride(1), num_heads,
                                            **_join_constexprs(latent_dim, num_splits))
    return out


def _decode_constexprs(latent_dim: int, rope_dim: int, block_size: int, num_splits: int) -> dict:
    return dict(LATENT_DIM=latent_dim, ROPE_DIM=rope_dim, BLOCK_SIZE=block_size, BLOCK_L=dot_block(latent_dim),
                BLOCK_R=dot_block(rope_dim), BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, NUM_SPLITS=num_splits)


def _join_constexprs(latent_dim: int, num_splits: int) -> dict:
    return dict(LATENT_DIM=latent_dim, BLOCK_L=triton.next_power_of_2(latent_dim), NUM_SPLITS=num_splits,
                BLOCK_S=triton.next_power_of_2(num_splits))


def _compile_cases(name: str, dtype: str, block_size: int, num_splits: int) -> list[dict]:
    """COMPILE_CASES entries (tools/compile_triton_kernels.py) for DeepSeek's 512 + 64 latent cache."""
    decode = {"partial_out": "*fp32", "partial_lse": "*fp32", "q": f"*{dtype}", "cache": f"*{dtype}",
              "block_tables": "*i32", "context_lens": "*i32", "qk_scale": "fp32", "num_heads": "i32",
              "keys_per_split": "i32", **{s: "i32" for s in ("stride_qb", "stride_qh", "stride_bt", "stride_block",
                                                               "stride_slot")}}
    decode_constexprs = _decode_constexprs(512, 64, block_size, num_splits)
    join = {"out": f"*{dtype}", "partial_out": "*fp32", "partial_lse": "*fp32", "stride_ob": "i32",
            "stride_oh": "i32", "num_heads": "i32"}
    join_constexprs = _join_constexprs(512, num_splits)
    return [dict(kernel=_latent_decode_kernel, name=name, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
                 signature={**decode, **{c: "constexpr" for c in decode_constexprs}}, constexprs=decode_constexprs),
            dict(kernel=_join_splits_kernel, name=f"{name}: join", num_warps=4, num_stages=3,
                 signature={**join, **{c: "constexpr" for c in join_constexprs}}, constexprs=join_constexprs)]


COMPILE_CASES = [*_compile_cases("latent 512 + rope 64, bf16, block 64, 8 splits", "bf16", 64, 8),
                 *_compile_cases("latent 512 + rope 64, fp16, block 16, 1 split", "fp16", 16, 1)]
