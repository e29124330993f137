"""The LoRA add of a batch whose rows each name an adapter slot (-1: none), BGMV style: one program per (row,
span of output columns) computes its row's shrink x[t] @ lora_a[s] in float32 (the rank padded to a power of two,
masked), then the expand onto its span, block by block, scales it and adds it into y. No host sync and no grouping
on the host, so a decode step with scattered slots stays graph-capturable.

Each program reads its slot's whole lora_a for the shrink: a few rows split their columns over many programs (the
GPU's SMs busy at decode), many rows give each program all of its row's columns (a prefill reads lora_a once a
row, not once a column block: at 8192 rows, K = N = 4096, R = 16, 1 GB of reads instead of 17)."""

import torch
import triton
import triton.language as tl

# Triton's CUDA defaults, named so that COMPILE_CASES compiles what the launcher runs
NUM_WARPS = 4
NUM_STAGES = 3
# elements of one program's tiles (lora_a's [BLOCK_K, BLOCK_R], lora_b's [BLOCK_R, BLOCK_N]): 32 registers a
# thread at 4 warps for the larger, whatever the rank
A_TILE = 2048
B_TILE = 4096
# programs a launch aims for when it splits rows' columns: several per SM on an H100/H200 (132) or A100 (108)
TARGET_PROGRAMS = 1024
try:  # knobs came in Triton 3.4
    from triton import knobs
    _INTERPRET = tl.constexpr(knobs.runtime.interpret)
except ImportError:
    _INTERPRET = tl.constexpr(False)


@triton.jit
def _to_bf16_grid(x):
    """float32 x rounded onto bfloat16's values, to nearest even (finite x): the interpreter's cast to bfloat16
    truncates, the GPU's cvt.rn rounds; after this both casts are exact."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _lora_add_kernel(
    y,
    x,
    lora_a,
    lora_b,
    scales,
    slots,
    stride_y,
    stride_x,
    K,
    N,
    R,
    span_n,  # columns a program adds into, a multiple of BLOCK_N
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots + row)
    if slot < 0:  # a row without an adapter keeps its base output
        return
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    # shrink: x[row] @ lora_a[slot], [BLOCK_R] in float32
    a_slot = lora_a + slot * K * R
    shrunk = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        xk = tl.load(x + row * stride_x + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        a = tl.load(a_slot + offs_k[:, None] * R + offs_r[None, :], mask=mask_k[:, None] & mask_r[None, :], other=0.0)
        shrunk += tl.sum(xk[:, None] * a.to(tl.float32), axis=0)
    # expand onto this program's span of columns, block by block: scaled, added in float32, rounded once
    scale = tl.load(scales + slot)
    b_slot = lora_b + slot * R * N
    for n0 in range(0, span_n, BLOCK_N):
        offs_n = tl.program_id(1) * span_n + n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        b = tl.load(b_slot + offs_r[:, None] * N + offs_n[None, :], mask=mask_r[:, None] & mask_n[None, :], other=0.0)
        delta = tl.sum(shrunk[:, None] * b.to(tl.float32), axis=0) * scale
        y_ptrs = y + row * stride_y + offs_n
        out = tl.load(y_ptrs, mask=mask_n).to(tl.float32) + delta
        if _INTERPRET:
            if y.dtype.element_ty == tl.bfloat16:
                out = _to_bf16_grid(out)
        tl.store(y_ptrs, out.to(y.dtype.element_ty), mask=mask_n)


def lora_add(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scales: torch.Tensor,
             slots: torch.Tensor) -> None:
    """y[t] += scales[s] * (x[t] @ lora_a[s]) @ lora_b[s] for each row t of slot s = slots[t] >= 0, in place, in
    float32, rounded to y's dtype once. y [T, N], x [T, K] (rows contiguous), lora_a [S, K, R], lora_b [S, R, N]
    (contiguous, y's dtype), scales float32 [S], slots int64 [T]."""
    num_rows, n = y.shape
    k, r = lora_a.shape[1:]
    assert x.shape == (num_rows, k) and lora_b.shape[1:] == (r, n) and slots.shape == (num_rows,)
    assert y.stride(1) == 1 and x.stride(1) == 1 and lora_a.is_contiguous() and lora_b.is_contiguous()
    assert scales.dtype == torch.float32 and scales.is_contiguous() and slots.is_contiguous()
    if num_rows == 0:
        return
    constexprs = _constexprs(k, n, r)
    span_n = _span_n(num_rows, n, constexprs["BLOCK_N"])
    grid = (num_rows, triton.cdiv(n, span_n))
    _lora_add_kernel[grid](y, x, lora_a, lora_b, scales, slots, y.stride(0), x.stride(0), k, n, r, span_n,
                           **constexprs, num_warps=NUM_WARPS, num_stages=NUM_STAGES)


def _span_n(num_rows: int, n: int, block_n: int) -> int:
    """The columns each program takes: a row's blocks split over as many programs as TARGET_PROGRAMS asks, no more
    (each reads the slot's lora_a again)."""
    blocks = triton.cdiv(n, block_n)
    programs_per_row = min(blocks, triton.cdiv(TARGET_PROGRAMS, num_rows))
    return triton.cdiv(blocks, programs_per_row) * block_n


def _constexprs(k: int, n: int, r: int) -> dict:
    """The kernel's tile sizes for one shape: what the launcher passes and COMPILE_CASES compile."""
    block_r = max(triton.next_power_of_2(r), 16)  # a rank under 16 padded: tiles of at least 16
    return dict(BLOCK_K=max(min(A_TILE // block_r, triton.next_power_of_2(k)), 16),
                BLOCK_N=max(min(B_TILE // block_r, triton.next_power_of_2(n)), 16), BLOCK_R=block_r)

def _compile_case(name: str, dtype: str, k: int, n: int, r: int) -> dict:
    """One COMPILE_CASES entry (tools/compile_triton_kernels.py): the kernel as the launcher calls it."""
    constexprs = _constexprs(k, n, r)
    signature = {"y": f"*{dtype}", "x": f"*{dtype}", "lora_a": f"*{dtype}", "lora_b": f"*{dtype}",
                 "scales": "*fp32", "slots": "*i64", **dict.fromkeys(["stride_y", "stride_x", "K", "N", "R", "span_n"], "i32"),
                 **dict.fromkeys(constexprs, "constexpr")}
    return {"kernel": _lora_add_kernel, "signature": signature, "constexprs": constexprs, "num_warps": NUM_WARPS,
            "num_stages": NUM_STAGES, "name": name}


# A typical rank and the largest one served (LoRA's rank 64, 128 seen in PEFT checkpoints); no shared memory is needed
COMPILE_CASES = [_compile_case("rank 16, 4096 -> 4096, bf16", "bf16", 4096, 4096, 16),
                 _compile_case("rank 128, 4096 -> 14336, fp16", "fp16", 4096, 14336, 128),
                 _compile_case("rank 8, 2048 -> 512, fp32", "fp32", 2048, 512, 8)]
