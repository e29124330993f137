"""Linear layers on the CPU run on oneDNN-packed weights (float32, and bfloat16 / float16 where the CPU computes
them): same products as F.linear, plain weights freed."""
import pytest
import torch
import torch.nn.functional as F

from tests.conftest import relative_error
from tpengine.layers.embed_head import ParallelLMHead
from tpengine.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from tpengine.platforms.cpu import pack_linear_weight
from tpengine.platforms.cpu_dtype import resolve_cpu_dtype

# skipped on the platform, never on the function under test: broken packing must fail these tests
HAS_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
needs_packing = pytest.mark.skipif(not HAS_ONEDNN, reason="this torch has no oneDNN")


@needs_packing
@pytest.mark.parametrize("cls", [ColumnParallelLinear, RowParallelLinear])
@pytest.mark.parametrize("rows", [1, 3, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear_and_frees_the_plain_weight(cls, rows, bias):
    torch.manual_seed(rows)
    layer = cls(96, 200, bias=bias)
    layer.weight.data.normal_()
    if bias:
        layer.bias.data.normal_()
    weight, bias_values = layer.weight.data.clone(), None if layer.bias is None else layer.bias.data.clone()
    x = torch.randn(rows, 96)
    layer.prepack()
    assert layer.packed_weight is not None and layer.weight.numel() == 0
    assert relative_error(layer(x), F.linear(x, weight, bias_values)) < 1e-5


@needs_packing
def test_merged_column_layer_loads_then_packs():
    layer = MergedColumnParallelLinear(32, [48, 48])
    gate, up = torch.randn(48, 32), torch.randn(48, 32)
    layer.weight_loader(layer.weight, gate, 0)
    layer.weight_loader(layer.weight, up, 1)
    layer.prepack()
    x = torch.randn(5, 32)
    assert relative_error(layer(x), x @ torch.cat([gate, up]).T) < 1e-5


@needs_packing
def test_lm_head_packs_but_keeps_the_weight_a_tied_embedding_shares():
    head = ParallelLMHead(1003, 64)
    head.weight.data.normal_()
    weight = head.weight.data.clone()
    head.prepack()
    assert torch.equal(head.weight.data, weight)
    x = torch.randn(7, 64)
    assert relative_error(head(x), x @ weight.T) < 1e-5


def test_no_packing_for_float64_so_it_keeps_f_linear():
    assert pack_linear_weight(torch.zeros(4, 4, dtype=torch.float64)) is None
    layer = ColumnParallelLinear(8, 4).to(torch.float64)
    layer.prepack()
    assert layer.packed_weight is None and layer.weight.numel() == 32


@needs_packing
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_half_weights_pack_where_the_cpu_computes_them_and_match_f_linear(dtype, rows):
    if resolve_cpu_dtype(dtype, log=False) != dtype:
        pytest.skip(f"this CPU runs {dtype} models in float32")
    torch.manual_seed(rows)
    layer = ColumnParallelLinear(96, 200, bias=True).to(dtype)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    weight, bias = layer.weight.data.clone(), layer.bias.data.clone()
    x = torch.randn(rows, 96, dtype=dtype)
    layer.prepack()
    assert layer.packed_weight is not None and layer.weight.numel() == 0
    out = layer(x)
    assert out.dtype == dtype
    # both accumulate in float32 and round once to the half dtype
    assert relative_error(out, F.linear(x.float(), weight.float(), bias.float())) < 1e-2


def test_a_fused_tensor_loads_as_its_parts_would():
    from tpengine.layers.linear import FUSED, QKVParallelLinear
    q, k, v, gate, up = (torch.randn(rows, 32) for rows in (64, 32, 32, 48, 48))
    split, fused = QKVParallelLinear(32, 16, 4, 2), QKVParallelLinear(32, 16, 4, 2)
    for shard_id, part in zip("qkv", (q, k, v)):
        split.weight_loader(split.weight, part, shard_id)
    fused.weight_loader(fused.weight, torch.cat([q, k, v]), FUSED)
    assert torch.equal(fused.weight, split.weight)
    merged = MergedColumnParallelLinear(32, [48, 48])
    merged.weight_loader(merged.weight, torch.cat([gate, up]), FUSED)
    assert torch.equal(merged.weight, torch.cat([gate, up]))
    with pytest.raises(ValueError, match=r"its shape is \[95, 32\], the model expects \[96, 32\]"):
        merged.weight_loader(merged.weight, torch.cat([gate, up])[:95], FUSED)
