"""Each form a CPU platform packs a weight in multiplies itself and gathers its own rows: the values of the float
weight it stands for, through the one linear and embedding_rows every platform shares."""
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import relative_error
from tpengine.kernels.cpu import bf16_linear as bf16_kernel
from tpengine.kernels.cpu import quant_linear as quant_kernel
from tpengine.platforms import cpu, torch_ops
from tpengine.platforms.packed import MinimumCorrected
from tpengine.quantization.online import quantize_weight


def forms():
    weight = quantize_weight(torch.randn(48, 64), 8)
    made = {"dequantized": (torch_ops.dequantized_weight(weight, torch.float32), weight.dequantize())}
    quantized = cpu.pack_quantized_weight(weight, torch.float32)
    if type(quantized) is cpu.QuantizedLinear:
        made["quantized"] = (quantized, weight.dequantize())
    # a float minimum per group (GGUF's Q4_K, ...), which no kernel reads: subtracted around the kernel's product
    with_minimums = replace(quantize_weight(torch.randn(48, 64), 4, group_size=32), minimums=torch.randn(48, 2))
    made["minimum corrected"] = (cpu.pack_quantized_weight(with_minimums, torch.float32), with_minimums.dequantize())
    if bf16_kernel.float_rows_available():
        floats = torch.randn(48, 64).bfloat16().float()
        made["bf16 blocks"] = (cpu.pack_linear_weight(floats, torch.bfloat16), floats)
    return made


@pytest.mark.parametrize("name", list(forms()))
def test_each_packed_form_multiplies_and_gathers_rows_as_its_float_weight(name):
    packed, weight = forms()[name]
    x, bias = torch.randn(3, 64), torch.randn(48)
    assert relative_error(cpu.linear(x, torch.empty(0), bias, packed), F.linear(x, weight, bias)) < 1e-4
    token_ids = torch.tensor([[0, 47], [5, 5]])
    assert torch.equal(cpu.embedding_rows(token_ids, packed, torch.float32), weight[token_ids])


def test_minimums_are_subtracted_around_the_cpu_kernels_product_in_float32_and_bfloat16():
    weight = replace(quantize_weight(torch.randn(48, 64), 4, group_size=32), minimums=torch.randn(48, 2))
    packed = cpu.pack_quantized_weight(weight, torch.float32)
    if quant_kernel.available():
        assert type(packed) is MinimumCorrected and type(packed.inner) is cpu.QuantizedLinear
    x = torch.randn(5, 64)
    assert relative_error(cpu.linear(x, torch.empty(0), None, packed), x @ weight.dequantize().T) < 1e-5
    half = x.bfloat16()
    assert relative_error(cpu.linear(half, torch.empty(0), None, packed).float(),
                          half.float() @ weight.dequantize().T) < 1e-2


def test_minimums_are_subtracted_around_tritons_gemm_too():
    """CUDA's packing (cuda.py, Triton's GEMM: in its interpreter without a GPU) wraps the same way."""
    pytest.importorskip("triton")
    from tpengine.platforms import cuda
    from tpengine.platforms.cuda_quant import TritonQuantLinear
    device = "cuda" if torch.cuda.is_available() else "cpu"
    weight = replace(quantize_weight(torch.randn(48, 64), 4, group_size=32), minimums=torch.randn(48, 2)).to(device)
    packed = cuda.pack_quantized_weight(weight, torch.float32)
    assert type(packed) is MinimumCorrected and type(packed.inner) is TritonQuantLinear
    x = torch.randn(5, 64, device=device)
    assert relative_error(packed.matmul(x, None), x @ weight.dequantize().T) < 1e-3
    token_ids = torch.tensor([[0, 47], [5, 5]], device=device)
    assert torch.equal(packed.rows(token_ids, torch.float32), weight.dequantize()[token_ids])


@pytest.mark.skipif(not bf16_kernel.available(), reason="the bfloat16 kernel needs AVX512-BF16")
def test_bfloat16_experts_packed_give_the_grouped_sum_of_their_floats():
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(6, 2 * 32, 64, generator=g).bfloat16(), torch.randn(6, 64, 32, generator=g).bfloat16()
    x = torch.randn(5, 64, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(5)])
    weights = torch.rand(5, 2, generator=g).bfloat16()
    packed = cpu.pack_float_experts(w13, w2)
    assert packed is not None and len(packed[0]) == len(packed[1]) == 6
    expected = cpu.moe_experts(x.float(), w13.float(), w2.float(), weights.float(), ids)
    assert relative_error(cpu.moe_experts(x, *packed, weights, ids), expected) < 2e-2


def test_float32_experts_stay_as_they_are():
    # their grouped matmuls keep torch's bits, which the float32 token tests against transformers rely on
    assert cpu.pack_float_experts(torch.randn(2, 8, 4), torch.randn(2, 4, 4)) is None
