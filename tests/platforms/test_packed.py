"""Each form a CPU platform packs a weight in multiplies itself and gathers its own rows: the values of the float
weight it stands for, through the one linear and embedding_rows every platform shares."""
import pytest
import torch
import torch.nn.functional as F

from tests.conftest import relative_error
from tpengine.kernels.cpu import bf16_linear as bf16_kernel
from tpengine.platforms import cpu, torch_ops
from tpengine.quantization.online import quantize_weight


def forms():
    weight = quantize_weight(torch.randn(48, 64), 8)
    made = {"dequantized": (torch_ops.dequantized_weight(weight, torch.float32), weight.dequantize())}
    quantized = cpu.pack_quantized_weight(weight, torch.float32)
    if type(quantized) is cpu.QuantizedLinear:
        made["quantized"] = (quantized, weight.dequantize())
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
