"""The block-FP8 GEMM against a float32 emulation: the same e4m3 values and scales, each k-block's products
summed in float32 and scaled, as the kernel does (on CPU in Triton's interpreter, which runs FP8 tl.dot)."""
import pytest
import torch

from tests.kernels.conftest import DEVICE
from tpengine.kernels.triton.fp8_matmul import COMPILE_CASES, DECODE_MAX_ROWS, block_fp8_matmul
from tpengine.quantization.fp8 import E4M3_MAX, quantize_fp8_activation

pytestmark = pytest.mark.usefixtures("triton_device")


def emulated_block_fp8_matmul(a, a_scales, b, b_scales, block_size):
    """float32 [M, N]: per k-block, (a . b) in float32 times the token's and the weight block's scales."""
    rows, columns = block_size
    M, K = a.shape
    out = torch.zeros(M, b.size(0))
    b_row_scales = b_scales.repeat_interleave(rows, 0)[:b.size(0)]
    for kb, start in enumerate(range(0, K, columns)):
        part = a[:, start:start + columns].float() @ b[:, start:start + columns].float().t()
        out += part * a_scales[:, kb:kb + 1] * b_row_scales[:, kb].unsqueeze(0)
    return out


def random_block_weight(N, K, block_size):
    rows, columns = block_size
    weight = torch.randn(N, K).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    scales = torch.rand(-(-N // rows), -(-K // columns)) / 100 + 1e-3
    return weight, scales


@pytest.mark.parametrize("M,N,K", [
    (3, 200, 320),   # decode: N and K not whole tiles, the last k-block partial
    (DECODE_MAX_ROWS + 54, 256, 256),  # prefill: two row tiles, the second partial
])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_block_fp8_matmul_equals_the_float32_emulation(M, N, K, out_dtype):
    block_size = (128, 128)
    x = torch.randn(M, K) * torch.linspace(0.1, 10, K)  # columns of very different sizes: groups matter
    a, a_scales = quantize_fp8_activation(x, block_size[1])
    b, b_scales = random_block_weight(N, K, block_size)
    out = block_fp8_matmul(a, a_scales, b, b_scales, block_size, out_dtype)
    expected = emulated_block_fp8_matmul(a, a_scales, b, b_scales, block_size)
    assert out.dtype == out_dtype and out.shape == (M, N)
    # float32: only the summation order differs; bfloat16: one rounding of each result, which the interpreter
    # truncates (a GPU rounds to nearest): up to one step, 2^-7 of the value
    tolerance = 1e-5 if out_dtype == torch.float32 else 2 ** -7
    # Hopper's FP8 tensor cores (wgmma, the prefill tile) keep about 14 bits of a k-block's running sum
    # (DeepSeek-V3's report), so there the error is bounded by the products' magnitude, not the result's; a
    # wrong scale or block is off by the magnitude itself
    accumulation = 0.0
    if DEVICE == "cuda":
        accumulation = 2 ** -9 * emulated_block_fp8_matmul(a.float().abs().to(a.dtype), a_scales,
                                                           b.float().abs().to(b.dtype), b_scales, block_size)
    assert ((out.float() - expected).abs() <= tolerance * expected.abs() + accumulation + 1e-6).all()


def test_weight_block_rows_smaller_than_the_column_tile_each_read_their_own_scale():
    block_size = (16, 64)  # four weight blocks down each 64-column tile
    a, a_scales = quantize_fp8_activation(torch.randn(5, 192), block_size[1])
    b, b_scales = random_block_weight(80, 192, block_size)
    out = block_fp8_matmul(a, a_scales, b, b_scales, block_size, torch.float32)
    expected = emulated_block_fp8_matmul(a, a_scales, b, b_scales, block_size)
    assert torch.allclose(out, expected, rtol=1e-5, atol=1e-6)


def test_compile_cases_list_every_kernel_argument_in_order():
    for case in COMPILE_CASES:
        kernel, signature = case["kernel"], case["signature"]
        assert list(signature) == kernel.arg_names
        assert {name for name, kind in signature.items() if kind == "constexpr"} == set(case["constexprs"])
        assert case["constexprs"]["BLOCK_K"] == 128 and signature["a"] == signature["b"] == "*fp8e4nv"
        assert case["min_capability"] == 89  # FP8 tensor cores; Triton refuses fp8e4nv for sm_80
