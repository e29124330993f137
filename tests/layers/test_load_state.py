"""What loading tracks on a parameter is one LoadState, attached by the layer that builds it."""
import torch

from tpengine.layers.embed_head import ParallelLMHead
from tpengine.layers.layernorm import RMSNorm
from tpengine.layers.linear import MergedColumnParallelLinear
from tpengine.layers.load_state import default_weight_loader, load_state, packed_as_loaded
from tpengine.quantization.fp8 import Fp8Weight
from tpengine.quantization.online import quantize_weight
from tpengine.quantization.weights import QuantizedWeight


def test_a_linear_attaches_its_loader_the_forms_it_takes_and_the_parts_that_fill_it():
    layer = MergedColumnParallelLinear(16, [8, 8], bias=True)
    state = layer.weight.load_state
    assert state.weight_loader == layer.weight_loader and state.shards == [(0,), (1,)]
    assert state.takes_form(torch.Tensor) and state.takes_form(QuantizedWeight) and state.takes_form(Fp8Weight)
    assert not layer.bias.load_state.takes_form(QuantizedWeight)


def test_a_parameter_no_layer_attached_a_state_to_loads_whole_and_float_only():
    state = load_state(RMSNorm(8).weight)
    assert state.weight_loader is default_weight_loader and state.shards == [()] and state.takes == ()


def test_a_parameter_shared_by_two_modules_is_packed_once():
    head = ParallelLMHead(32, 16)
    head.weight_loader(head.weight, quantize_weight(torch.randn(32, 16), 8))
    packs = []

    def pack(whole, dtype):
        packs.append(whole)
        return ("packed", whole.shape)

    first = packed_as_loaded(head.weight, None, pack, None)
    assert packed_as_loaded(head.weight, None, pack, None) is first and len(packs) == 1
    assert head.weight.numel() == 0 and head.weight.load_state.quantized_parts == {}
