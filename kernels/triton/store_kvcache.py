"""Scatter new tokens' keys and values into their slots of the paged KV cache."""

import torch
import triton
import triton.language as tl

# Triton's CUDA defaults, named so that COMPILE_CASES compiles what the launcher runs
NUM_WARPS = 4
NUM_STAGES = 3


@triton.jit
def _store_kvcache_kernel(
    key,
    value,
    k_cache,
    v_cache,
    slot_mapping,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_block,
    stride_slot,
    stride_kv_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per token, covering all its kv heads.
    token = tl.program_id(0)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    # Slot -1 marks a padding token that owns no cache slot.
    if slot < 0:
        return

    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    mask = (offs_h < NUM_KV_HEADS) & (offs_d < HEAD_DIM)
    k = tl.load(key + token * stride_kt + offs_h * stride_kh + offs_d, mask=mask)
    v = tl.load(value + token * stride_vt + offs_h * stride_vh + offs_d, mask=mask)
    slot_offset = (slot // BLOCK_SIZE) * stride_block + (slot % BLOCK_SIZE) * stride_slot
    cache_offs = slot_offset + offs_h * stride_kv_head + offs_d
    tl.store(k_cache + cache_offs, k, mask=mask)
    tl.store(v_cache + cache_offs, v, mask=mask)


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] to cache slots slot_mapping[t] (-1: skip).

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]; slot s is at
    block s // block_size, offset s % block_size. key/value may be strided views (last dim contiguous).
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    block_size = k_cache.shape[1]
    assert value.shape == key.shape and k_cache.shape[2:] == (num_kv_heads, head_dim)
    assert key.stride(-1) == 1 and value.stride(-1) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert slot_mapping.shape == (num_tokens,)

    _store_kvcache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        **_constexprs(num_kv_heads, head_dim, block_size), num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )


def _constexprs(num_kv_heads: int, head_dim: int, block_size: int) -> dict:
    """The kernel's compile-time arguments for one cache shape: what the launcher passes and COMPILE_CASES compile."""
    return dict(NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
                BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim))


def _compile_case(name: str, dtype: str, num_kv_heads: int, head_dim: int, block_size: int) -> dict:
    """One COMPILE_CASES entry (scripts/compile_triton_kernels.py): the kernel as the launcher calls it."""
    ints = ["stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_block", "stride_slot", "stride_kv_head"]
    signature = {"key": f"*{dtype}", "value": f"*{dtype}", "k_cache": f"*{dtype}", "v_cache": f"*{dtype}",
                 "slot_mapping": "*i64", **dict.fromkeys(ints, "i32")}
    constexprs = _constexprs(num_kv_heads, head_dim, block_size)
    return {"kernel": _store_kvcache_kernel, "signature": {**signature, **dict.fromkeys(constexprs, "constexpr")},
            "constexprs": constexprs, "num_warps": NUM_WARPS, "num_stages": NUM_STAGES, "name": name}


# The largest tile a supported model stores per token (Gemma 2 9B: 8 kv heads x 256); it uses no shared memory.
COMPILE_CASES = [_compile_case("8 kv heads x head_dim 256, bf16, block 256", "bf16", 8, 256, 256)]
