"""The CUDA platform's FP8 linears, on the GPU where there is one, else on CPU tensors: torch._scaled_mm has a
CPU reference implementation and the block kernel runs in Triton's interpreter. Each is measured against the
float32 product of the same e4m3 values and scales (what the GPU's FP8 GEMM computes, up to summation order and
the bfloat16 output)."""
import pytest
import torch

from tpengine.kernels.triton.quant_matmul import QuantMatmulWeight
from tpengine.platforms import cuda, torch_ops
from tpengine.platforms.cuda_fp8 import Fp8Linear, fp8_linear, pack_fp8_weight, runs_fp8
from tpengine.platforms.cuda_quant import TritonQuantLinear
from tpengine.quantization.fp8 import Fp8Weight, quantize_fp8_activation, quantize_fp8_weight
from tpengine.quantization.online import quantize_weight

# a GPU without FP8 (before sm_89) runs _scaled_mm's CPU reference; Triton runs compiled there, so not the kernel
DEVICE = "cuda" if torch.cuda.is_available() and runs_fp8(torch.cuda.get_device_capability()) else "cpu"


def emulated(x, fp8: Fp8Weight):
    """float32: x quantized as the linear quantizes it, times the weight's e4m3 values, scaled."""
    group = None if fp8.block_size is None else fp8.block_size[1]
    values, scales = quantize_fp8_activation(x.reshape(-1, x.size(-1)), group, fp8.input_scale)
    columns = scales.repeat_interleave(group, 1)[:, :x.size(-1)] if group else scales
    return ((values.float() * columns) @ fp8.dequantize().t()).view(*x.shape[:-1], -1)


def close_in_bfloat16(out, product, bias=None):
    """out is product (+ bias) up to the bfloat16 roundings of the product and of the sum (the interpreter
    truncates: a step each, 2^-7 of the value)."""
    bias = torch.zeros(()) if bias is None else bias.float()
    return ((out.float() - (product + bias)).abs() <= 2 ** -6 * (product.abs() + bias.abs())).all()


def test_fp8_needs_compute_capability_8_9():
    assert not runs_fp8((8, 0)) and not runs_fp8((8, 6)) and runs_fp8((8, 9)) and runs_fp8((9, 0))


def test_the_cuda_platform_packs_fp8_for_its_gemm_and_integer_weights_for_theirs():
    assert type(cuda.pack_quantized_weight(quantize_fp8_weight(torch.randn(32, 64)), torch.bfloat16)) is Fp8Linear
    packed = cuda.pack_quantized_weight(quantize_weight(torch.randn(32, 64), 8), torch.bfloat16)
    assert type(packed) is TritonQuantLinear and isinstance(packed, QuantMatmulWeight)


def test_per_tensor_scales_become_one_row_wise_scale_per_output_channel():
    channel = quantize_fp8_weight(torch.randn(32, 64))
    tensor = Fp8Weight(channel.weight, torch.tensor([[0.5]]))
    assert torch.equal(pack_fp8_weight(tensor, torch.bfloat16).scales, torch.full((1, 32), 0.5))
    assert torch.equal(pack_fp8_weight(channel, torch.bfloat16).scales, channel.scales.t())


def test_a_weight_neither_gemm_takes_runs_as_its_float_value():
    odd = quantize_fp8_weight(torch.randn(24, 40))  # _scaled_mm tiles by 16
    packed = pack_fp8_weight(odd, torch.bfloat16)
    assert type(packed) is torch_ops.DequantizedWeight and torch.equal(packed.weight, odd.dequantize(torch.bfloat16))


@pytest.fixture
def fp8_device():
    """Tensors the test creates land on the GPU where it runs FP8 (its compiled kernel and cuBLAS' FP8 GEMM)."""
    with torch.device(DEVICE):
        yield


@pytest.mark.usefixtures("fp8_device")
@pytest.mark.parametrize("input_scale", [None, 0.05])
def test_channel_scaled_linear_through_scaled_mm_equals_the_emulation(input_scale):
    fp8 = quantize_fp8_weight(torch.randn(48, 64))
    if input_scale is not None:
        fp8 = Fp8Weight(fp8.weight, fp8.scales, input_scale=torch.tensor([[input_scale]]))
    x = torch.randn(2, 3, 64).bfloat16()
    bias = torch.randn(48).bfloat16()
    out = fp8_linear(x, pack_fp8_weight(fp8, torch.bfloat16), bias)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3, 48)
    assert close_in_bfloat16(out, emulated(x.float(), fp8), bias)


@pytest.mark.skipif(torch.cuda.is_available() and DEVICE == "cpu", reason="this GPU has no FP8 (sm_89+)")
@pytest.mark.usefixtures("fp8_device")
def test_block_scaled_linear_through_the_triton_kernel_equals_the_emulation():
    weight = torch.randn(256, 256).clamp(-448, 448).to(torch.float8_e4m3fn)
    fp8 = Fp8Weight(weight, torch.rand(2, 2) / 100 + 1e-3, block_size=(128, 128))
    x = torch.randn(5, 256).bfloat16()
    out = fp8_linear(x, pack_fp8_weight(fp8, torch.bfloat16), None)
    assert out.dtype == torch.bfloat16 and close_in_bfloat16(out, emulated(x.float(), fp8))
