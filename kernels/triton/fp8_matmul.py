"""FP8 (e4m3) GEMM with block scales, as DeepSeek-V3 and Qwen3's FP8 releases quantize: a weight scale per
block of BLOCK_SCALE_N rows x BLOCK_K columns and an activation scale per token per BLOCK_K columns.

    c[m, n] = sum over k-blocks kb of (a[m, kb] . b[n, kb]) * a_scales[m, kb] * b_scales[n // BLOCK_SCALE_N, kb]

Each k-block's e4m3 dot product is accumulated in float32 by the tensor cores, then scaled: the scales
change every BLOCK_K columns, so BLOCK_K is the weight block's column count. FP8 tensor cores exist from
sm_89 (Ada, Hopper) on: these kernels target sm_89+ only (sm_80 has no FP8 MMA), and the CUDA platform
keeps FP8 weights only there.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _block_fp8_matmul_kernel(
    a,             # [M, K] e4m3: activations
    a_scales,      # [M, cdiv(K, BLOCK_K)] float32
    b,             # [N, K] e4m3: the weight, as nn.Linear stores it
    b_scales,      # [cdiv(N, BLOCK_SCALE_N), cdiv(K, BLOCK_K)] float32
    c,             # [M, N]
    M, N, K,
    stride_am, stride_asm, stride_bn, stride_bsn, stride_cm,
    BLOCK_SCALE_N,  # the weight block's rows
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # the weight block's columns, = the activation group
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m < M, offs_n < N
    a_ptrs = a + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    b_ptrs = b + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    a_scale_ptrs = a_scales + offs_m * stride_asm
    b_scale_ptrs = b_scales + (offs_n // BLOCK_SCALE_N) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        mask_k = offs_k < K - kb * BLOCK_K  # the last block may be partial: its missing columns read 0
        a_block = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b_block = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        a_scale = tl.load(a_scale_ptrs + kb, mask=mask_m, other=0.0)
        b_scale = tl.load(b_scale_ptrs + kb, mask=mask_n, other=0.0)
        acc += tl.dot(a_block, b_block) * a_scale[:, None] * b_scale[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    c_ptrs = c + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


# (BLOCK_M, BLOCK_N, num_warps, num_stages): a decode step's few rows read the weight once, in narrow
# column tiles for more programs; prefill takes wider tiles that reuse each weight tile over 64 rows
DECODE_MAX_ROWS = 16
_DECODE_TILE = (16, 64, 4, 4)
_PREFILL_TILE = (64, 128, 4, 3)


def block_fp8_matmul(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                     block_size: tuple[int, int], out_dtype: torch.dtype) -> torch.Tensor:
    """a [M, K] e4m3 with a_scales [M, cdiv(K, block columns)] times b [N, K] e4m3 with b_scales
    [cdiv(N, block rows), cdiv(K, block columns)], transposed: [M, N] in out_dtype."""
    M, K = a.shape
    N = b.size(0)
    block_rows, block_columns = block_size
    assert a.dtype == b.dtype == torch.float8_e4m3fn and a.stride(1) == b.stride(1) == 1
    assert a_scales.shape == (M, triton.cdiv(K, block_columns)) and a_scales.stride(1) == 1
    assert b_scales.shape == (triton.cdiv(N, block_rows), triton.cdiv(K, block_columns)) and b_scales.stride(1) == 1
    c = torch.empty(M, N, dtype=out_dtype, device=a.device)
    block_m, block_n, num_warps, num_stages = _DECODE_TILE if M <= DECODE_MAX_ROWS else _PREFILL_TILE
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _block_fp8_matmul_kernel[grid](
        a, a_scales, b, b_scales, c, M, N, K,
        a.stride(0), a_scales.stride(0), b.stride(0), b_scales.stride(0), c.stride(0), block_rows,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_columns, num_warps=num_warps, num_stages=num_stages)
    return c


def _compile_case(name: str, tile: tuple[int, int, int, int]) -> dict:
    block_m, block_n, num_warps, num_stages = tile
    return {"kernel": _block_fp8_matmul_kernel, "name": name, "num_warps": num_warps, "num_stages": num_stages,
            "min_capability": 89,
            "signature": {"a": "*fp8e4nv", "a_scales": "*fp32", "b": "*fp8e4nv", "b_scales": "*fp32", "c": "*bf16",
                          **{arg: "i32" for arg in ("M", "N", "K", "stride_am", "stride_asm", "stride_bn",
                                                    "stride_bsn", "stride_cm", "BLOCK_SCALE_N")},
                          "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"},
            "constexprs": {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": 128}}


# what runs on a GPU (128x128 blocks, bfloat16 out), for the ahead-of-time compile check: sm_89+ only
# (min_capability; for sm_80 Triton refuses: "type fp8e4nv not supported in this architecture")
COMPILE_CASES = [_compile_case("block_fp8_decode", _DECODE_TILE), _compile_case("block_fp8_prefill", _PREFILL_TILE)]
