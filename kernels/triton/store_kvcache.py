"""Scatter new tokens' keys and values into their slots of the paged KV cache (an FP8 cache: quantized on the way)."""

import torch
import triton
import triton.language as tl

# Triton's CUDA defaults, named so that COMPILE_CASES compiles what the launcher runs
NUM_WARPS = 4
NUM_STAGES = 3

FP8_MAX = tl.constexpr(448.0)  # e4m3's largest finite value (torch.finfo(torch.float8_e4m3fn).max)
try:  # this kernel runs on any Triton (the flash-attn backend's store); knobs came in 3.4
    from triton import knobs
    _INTERPRET = tl.constexpr(knobs.runtime.interpret)
except ImportError:
    _INTERPRET = tl.constexpr(False)


@triton.jit
def _to_e4m3(x):
    """float32 x, |x| <= FP8_MAX, to e4m3 rounding to nearest even, as torch's cast and the GPU's cvt.rn round."""
    if _INTERPRET:
        # The interpreter's cast rounds half up and drops the carry into the exponent (1.96 -> 1.0): round x
        # onto e4m3's grid in float32 arithmetic first, so the cast is exact. The grid step is 2^(exponent - 3),
        # and 2^-9 below 2^-6 (subnormals); adding and taking away 1.5 * 2^23 steps rounds to it, ties to even.
        bits = x.to(tl.int32, bitcast=True)
        step_exponent = tl.maximum(((bits >> 23) & 0xFF) - 3, 127 - 9)
        magic = ((step_exponent + 23) << 23).to(tl.float32, bitcast=True) * 1.5
        rounded = (tl.abs(x) + magic) - magic
        x = tl.where(bits < 0, -rounded, rounded)  # the sign bit: -0.0 too
    return x.to(tl.float8e4nv)


@triton.jit
def _store_kvcache_kernel(
    key,
    value,
    k_cache,
    v_cache,
    slot_mapping,
    k_scale,  # FP8 cache: pointers to the layer's float32 scales (unread otherwise)
    v_scale,
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
    FP8_KV: tl.constexpr,
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
    if FP8_KV:  # e4m3(x / scale) in float32, clamped first: a cast past e4m3's range gives NaN
        k = _to_e4m3(tl.clamp(k.to(tl.float32) / tl.load(k_scale), -FP8_MAX, FP8_MAX))
        v = _to_e4m3(tl.clamp(v.to(tl.float32) / tl.load(v_scale), -FP8_MAX, FP8_MAX))
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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] to cache slots slot_mapping[t] (-1: skip).

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]; slot s is at
    block s // block_size, offset s % block_size. key/value may be strided views (last dim contiguous).
    An FP8 (e4m3) cache gets e4m3(clamp(x / scale)), k_scale and v_scale float32 tensors of one element.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    block_size = k_cache.shape[1]
    assert value.shape == key.shape and k_cache.shape[2:] == (num_kv_heads, head_dim)
    assert key.stride(-1) == 1 and value.stride(-1) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert slot_mapping.shape == (num_tokens,)
    fp8_kv = k_cache.dtype == torch.float8_e4m3fn
    assert not fp8_kv or (k_scale is not None and v_scale is not None)

    _store_kvcache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        k_scale if fp8_kv else slot_mapping, v_scale if fp8_kv else slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        **_constexprs(num_kv_heads, head_dim, block_size, fp8_kv), num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )


def _constexprs(num_kv_heads: int, head_dim: int, block_size: int, fp8_kv: bool) -> dict:
    """The kernel's compile-time arguments for one cache shape: what the launcher passes and COMPILE_CASES compile."""
    return dict(NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
                BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim), FP8_KV=fp8_kv)


def _compile_case(name: str, dtype: str, num_kv_heads: int, head_dim: int, block_size: int,
                  fp8_kv: bool = False) -> dict:
    """One COMPILE_CASES entry (tools/compile_triton_kernels.py): the kernel as the launcher calls it (without an
    FP8 cache, slot_mapping stands in for the scales it never reads)."""
    ints = ["stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_block", "stride_slot", "stride_kv_head"]
    cache, scale = ("*fp8e4nv", "*fp32") if fp8_kv else (f"*{dtype}", "*i64")
    signature = {"key": f"*{dtype}", "value": f"*{dtype}", "k_cache": cache, "v_cache": cache,
                 "slot_mapping": "*i64", "k_scale": scale, "v_scale": scale, **dict.fromkeys(ints, "i32")}
    constexprs = _constexprs(num_kv_heads, head_dim, block_size, fp8_kv)
    case = {"kernel": _store_kvcache_kernel, "signature": {**signature, **dict.fromkeys(constexprs, "constexpr")},
            "constexprs": constexprs, "num_warps": NUM_WARPS, "num_stages": NUM_STAGES, "name": name}
    return {**case, "min_capability": 89} if fp8_kv else case  # e4m3 needs sm_89+


# The largest tile a supported model stores per token (Gemma 2 9B: 8 kv heads x 256); it uses no shared memory.
COMPILE_CASES = [_compile_case("8 kv heads x head_dim 256, bf16, block 256", "bf16", 8, 256, 256),
                 _compile_case("8 kv heads x head_dim 128, bf16 into an FP8 cache, block 256", "bf16", 8, 128, 256,
                               fp8_kv=True)]
