"""One online-softmax step over a tile of keys read from the paged KV cache.

Shared by the decode and prefill kernels: both walk a sequence's keys in tiles
of BLOCK_N positions, map positions to cache slots through the block table and
fold each tile into a running (max, sum, accumulator) softmax state. An FP8 cache's
tile is dequantized on load: float32(fp8) * scale, rounded to the query's dtype.
"""

import triton
import triton.language as tl

# constexpr: compiled jit code may read no other globals (a plain float ran only in the interpreter)
LOG2E = tl.constexpr(1.4426950408889634)
# The Triton interpreter has no bfloat16 arithmetic (tl.dot multiplies the raw uint16 bits).
_INTERPRET = tl.constexpr(triton.knobs.runtime.interpret)


def dot_block(n: int) -> int:
    """Tile extent for a dimension fed to tl.dot: a power of two, at least 16 (the MMA minimum)."""
    return max(16, triton.next_power_of_2(n))


@triton.jit
def _dot(a, b):
    if _INTERPRET and a.dtype == tl.bfloat16:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    # "ieee" keeps fp32 inputs exact on GPUs (the default would round them to tf32).
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _tanh(x):
    # tl has no tanh on every backend: 1 - 2 / (exp(2x) + 1), exact at both ends
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def attend_paged_kv_tile(
    acc,  # [M, BLOCK_D] fp32 running numerator
    m_i,  # [M] fp32 running row max (log2 domain)
    l_i,  # [M] fp32 running row sum
    q,  # [M, BLOCK_D] query rows, in the cache's dtype (an FP8 cache: its dequantized tiles take q's)
    k_cache,
    v_cache,
    k_scale,  # FP8 cache: pointers to the layer's float32 scales (unread otherwise)
    v_scale,
    block_table,  # pointer to this sequence's row of the block table
    kv_head_offset,  # kv_head * stride of the head dim in the cache
    stride_block,
    stride_slot,
    start_n,  # first key position of this tile
    kv_len,  # keys in the sequence; positions >= kv_len are never read
    row_limit,  # [M] int: row r attends to positions < row_limit[r] <= kv_len
    row_start,  # [M] int: and to positions >= row_start[r] (its sliding window; 0 without one)
    qk_scale,  # softmax scale * log2(e), so exp2 can replace exp
    softcap,  # > 0: scores become softcap * tanh(scores / softcap), in the log2 domain here
    offs_d,
    d_mask,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8_KV: tl.constexpr,
):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_mask = (offs_n < kv_len) & (offs_n >= tl.min(row_start, axis=0))
    # Masked so that block-table entries past the sequence's blocks, or before every row's window (blocks the
    # ledger may have freed), are never used.
    block = tl.load(block_table + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    offs_kv = block * stride_block + (offs_n % BLOCK_SIZE) * stride_slot + kv_head_offset
    kv_ptrs = offs_kv[:, None] + offs_d[None, :]
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_cache + kv_ptrs, mask=kv_mask, other=0.0)
    v = tl.load(v_cache + kv_ptrs, mask=kv_mask, other=0.0)
    if FP8_KV:  # then the products run as with a cache of the query's dtype
        k = (k.to(tl.float32) * tl.load(k_scale)).to(q.dtype)
        v = (v.to(tl.float32) * tl.load(v_scale)).to(q.dtype)

    s = _dot(q, tl.trans(k)) * qk_scale
    if softcap > 0:  # qk_scale carries log2(e): cap the natural-log scores, then return to log2
        s = softcap * LOG2E * _tanh(s / (softcap * LOG2E))
    visible = (offs_n[None, :] < row_limit[:, None]) & (offs_n[None, :] >= row_start[:, None])
    s = tl.where(visible, s, float("-inf"))
    return fold_tile(acc, m_i, l_i, s, v)


@triton.jit
def fold_tile(acc, m_i, l_i, s, v):
    """The running softmax state (acc [M, D], m_i [M], l_i [M]) with a tile folded in: s [M, N] its scores in the
    log2 domain (-inf where hidden), v [N, D] its values."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row may have seen no key yet (its window starts later): exp2 must not see -inf - -inf
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v)
    return acc, m_new, l_i


# (name, dtype, head_dim, group_size, block_size, has_sinks, fp8_kv) compiled for each paged attention kernel: the
# largest tiles (head_dim 256, Gemma 2) and the common head_dim 128, between them both cache dtypes, both block
# sizes, sinks and an FP8 cache (any group up to 16 gives decode's BLOCK_G 16, the MMA minimum; in prefill the group
# only picks a head's kv head); each costs the test suite seconds
ATTENTION_COMPILE_SHAPES = [
    ("head_dim 256, group 2, bf16, block 256", "bf16", 256, 2, 256, False, False),
    ("head_dim 128, group 4, fp16, block 16, sinks", "fp16", 128, 4, 16, True, False),
    ("head_dim 128, group 4, bf16, FP8 cache, block 256", "bf16", 128, 4, 256, False, True),
]


def attention_compile_case(kernel, name: str, dtype: str, index_args: list[str], strides: list[str],
                           constexprs: dict, num_warps: int, num_stages: int) -> dict:
    """One COMPILE_CASES entry (tools/compile_triton_kernels.py) of a paged attention kernel, whose arguments run
    out, q, k_cache, v_cache, index_args (int32 tensors), sinks, k_scale, v_scale, qk_scale, window, softcap, strides.
    Without sinks or an FP8 cache, q stands in for the tensors the kernel never reads."""
    fp8_kv = constexprs["FP8_KV"]
    cache, scale = ("*fp8e4nv", "*fp32") if fp8_kv else (f"*{dtype}", f"*{dtype}")
    signature = {"out": f"*{dtype}", "q": f"*{dtype}", "k_cache": cache, "v_cache": cache,
                 **dict.fromkeys(index_args, "*i32"), "sinks": "*fp32" if constexprs["HAS_SINKS"] else f"*{dtype}",
                 "k_scale": scale, "v_scale": scale, "qk_scale": "fp32", "window": "i32", "softcap": "fp32",
                 **dict.fromkeys(strides, "i32"), **dict.fromkeys(constexprs, "constexpr")}
    case = {"kernel": kernel, "signature": signature, "constexprs": constexprs, "num_warps": num_warps,
            "num_stages": num_stages, "name": name}
    return {**case, "min_capability": 89} if fp8_kv else case  # e4m3 needs sm_89+
