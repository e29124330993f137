"""FP8 linears kept as FP8 (Fp8Weight): read from compressed-tensors float-quantized and "fp8"-method checkpoints,
sharded and joined as the layers do, quantized online, and their inputs quantized; each measured against the
float weights the CPU reads the same checkpoint into."""
import json
import os

import pytest
import torch
import torch.nn.functional as F

from tests.quantization.checkpoints import (CheckpointFormat, QUANTIZED_LINEAR, _copy_with_config, _read_checkpoint,
                                            pack_fp8, quantization_config)
from tpengine.attention import make_backend
from tpengine.config import EngineConfig
from tpengine.distributed.parallel_state import TensorParallelGroup, building_model_for
from tpengine.hf_config import load_hf_config, quantization_config_of
from tpengine.layers.load_state import packed_quantized
from tpengine.models.loader import OnlineQuantization, load_model, online_quantization
from tpengine.models.registry import model_class
from tpengine.quantization.config import QuantizationConfig
from tpengine.quantization.fp8 import E4M3_MAX, Fp8Weight, cat_fp8_rows, quantize_fp8_activation, quantize_fp8_weight



QWEN_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}


def _weight(out_features: int = 48, in_features: int = 64, seed: int = 0) -> torch.Tensor:
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    weight[3] = 0  # an all-zero row (and block) must not divide by zero
    return weight


def block_fp8(weight: torch.Tensor, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's layout of a float weight: e4m3 values and weight_scale_inv [out / rows, in / columns] (it
    multiplies), each block's absmax / 448."""
    rows, columns = block
    weight = weight.float()
    out_features, in_features = weight.shape
    padded = F.pad(weight, (0, -in_features % columns, 0, -out_features % rows))
    blocks = padded.view(padded.size(0) // rows, rows, padded.size(1) // columns, columns)
    scale = blocks.abs().amax(dim=(1, 3)) / E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    expanded = scale.repeat_interleave(rows, 0)[:out_features].repeat_interleave(columns, 1)[:, :in_features]
    return {"weight": (weight / expanded).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn),
            "weight_scale_inv": scale}


# --- reading --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["tensor", "channel"])
def test_compressed_tensors_fp8_kept_dequantizes_to_the_float_read(strategy):
    fmt = CheckpointFormat("float-quantized", fp8_strategy=strategy)
    tensors = pack_fp8(_weight(), fmt, torch.bfloat16)
    config = QuantizationConfig.from_hf(quantization_config(fmt))
    kept = config.read_linear("model.layers.0.mlp.up_proj", tensors, keep_fp8=True)
    assert isinstance(kept, Fp8Weight) and kept.weight.dtype == torch.float8_e4m3fn and kept.input_scale is None
    assert kept.scales.shape == ((1, 1) if strategy == "tensor" else (48, 1))
    assert torch.equal(kept.dequantize(), config.read_linear("model.layers.0.mlp.up_proj", tensors))


def test_compressed_tensors_fp8_blocks_and_static_input_scale_are_kept():
    fmt = CheckpointFormat("float-quantized")
    config = quantization_config(fmt)
    config["config_groups"]["group_0"]["weights"].update(strategy="block", block_structure=[16, 32])
    config["config_groups"]["group_0"]["input_activations"].update(strategy="tensor", dynamic=False)
    config = QuantizationConfig.from_hf(config)
    tensors = block_fp8(_weight(), (16, 32))
    tensors = {"weight": tensors["weight"], "weight_scale": tensors.pop("weight_scale_inv").bfloat16(),
               "input_scale": torch.tensor([0.25], dtype=torch.bfloat16)}
    kept = config.read_linear("model.layers.0.mlp.up_proj", tensors, keep_fp8=True)
    assert kept.block_size == (16, 32) and kept.scales.shape == (3, 2)
    assert torch.equal(kept.input_scale, torch.tensor([[0.25]]))
    assert torch.equal(kept.dequantize(), config.read_linear("model.layers.0.mlp.up_proj", tensors))


def test_fp8_method_reads_weight_scale_inv_blocks_as_a_multiplier():
    weight = _weight(40, 72)  # partial last blocks both ways
    tensors = block_fp8(weight, (16, 16))
    config = QuantizationConfig.from_hf(QWEN_FP8)
    read = config.read_linear("model.layers.0.self_attn.q_proj", tensors)
    scale = tensors["weight_scale_inv"].repeat_interleave(16, 0)[:40].repeat_interleave(16, 1)[:, :72]
    assert read.dtype == torch.float32 and torch.equal(read, tensors["weight"].float() * scale)
    assert (read - weight).abs().max() <= weight.abs().max() / 16  # e4m3 keeps 3 mantissa bits
    kept = config.read_linear("model.layers.0.self_attn.q_proj", tensors, keep_fp8=True)
    assert kept.block_size == (16, 16) and torch.equal(kept.dequantize(), read)
    assert config.is_quantized("model.layers.0.self_attn.q_proj", {"weight", "weight_scale_inv"})
    assert not config.is_quantized("model.layers.0.input_layernorm", {"weight"})


def test_fp8_method_without_blocks_reads_a_per_tensor_scale_and_static_input_scale():
    config = QuantizationConfig.from_hf({"quant_method": "fp8", "activation_scheme": "static",
                                         "ignored_layers": ["model.layers.0.mlp.down_proj"]})
    tensors = pack_fp8(_weight(), CheckpointFormat("float-quantized", fp8_strategy="tensor"), torch.float32)
    tensors["input_scale"] = torch.tensor(0.5)
    kept = config.read_linear("model.layers.1.mlp.up_proj", tensors, keep_fp8=True)
    assert kept.scales.shape == (1, 1) and kept.input_scale.item() == 0.5
    assert torch.equal(kept.dequantize(), tensors["weight"].float() * tensors["weight_scale"])
    assert config.skips("model.layers.0.mlp.down_proj") and not config.skips("model.layers.1.mlp.down_proj")


def test_fp8_method_non_finite_block_scales_and_input_scales_are_refused_naming_the_tensor():
    blocks = QuantizationConfig.from_hf(QWEN_FP8)
    tensors = block_fp8(_weight(), (16, 16))
    tensors["weight_scale_inv"][1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"q_proj.weight_scale_inv has 1 non-finite values \(NaN or Inf\)"):
        blocks.read_linear("model.layers.0.self_attn.q_proj", tensors, keep_fp8=True)
    static = QuantizationConfig.from_hf({"quant_method": "fp8", "activation_scheme": "static"})
    tensors = pack_fp8(_weight(), CheckpointFormat("float-quantized", fp8_strategy="tensor"), torch.float32)
    with pytest.raises(ValueError, match=r"q_proj.input_scale has 1 non-finite values"):
        static.read_linear("model.layers.0.self_attn.q_proj", {**tensors, "input_scale": torch.tensor(float("inf"))})


@pytest.mark.parametrize("change,message", [
    ({"fmt": "e5m2"}, "fp8 fmt 'e5m2' is not supported"),
    ({"activation_scheme": "static"}, "activation_scheme 'static' is not supported with blocks"),
    ({"weight_block_size": [128]}, r"weight_block_size \[128\] must be \[rows, columns\]"),
    ({"kv_cache_quant": True}, r"keys \['kv_cache_quant'\] are not supported"),
])
def test_fp8_method_configs_tpengine_cannot_read_are_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        QuantizationConfig.from_hf({**QWEN_FP8, **change})


# --- sharding and joining -------------------------------------------------------------------------------

def _kept_blocks(out_features=64, in_features=64, block=(16, 16), seed=0) -> Fp8Weight:
    tensors = block_fp8(_weight(out_features, in_features, seed), block)
    return Fp8Weight(tensors["weight"], tensors["weight_scale_inv"], block)


def test_shards_of_a_block_scaled_weight_dequantize_to_the_shards_of_its_float_value():
    kept = _kept_blocks()
    whole = kept.dequantize()
    assert torch.equal(kept.rows(16, 32).dequantize(), whole[16:48])
    assert torch.equal(kept.columns(32, 32, 2).dequantize(), whole[:, 32:])


def test_a_shard_that_splits_a_block_names_its_width_and_the_block_s():
    kept = _kept_blocks(block=(32, 32))
    with pytest.raises(ValueError, match="tensor parallel size 4 splits an FP8 weight block: a rank takes 16 input "
                                         "features from 16, not a multiple of the block's 32 columns"):
        kept.columns(16, 16, 4)
    with pytest.raises(ValueError, match="takes 16 output features from 0, not a multiple of the block's 32 rows"):
        kept.rows(0, 16)


def test_joined_projections_keep_each_part_s_scales():
    tensor_scaled = [Fp8Weight(quantize_fp8_weight(_weight(16, 32, seed)).weight, torch.tensor([[seed + 1.0]]),
                     input_scale=torch.tensor([[0.1 * (seed + 1)]])) for seed in range(3)]
    joined = cat_fp8_rows(tensor_scaled)
    assert joined.scales.shape == (48, 1) and joined.input_scale.item() == pytest.approx(0.3)
    assert torch.equal(joined.dequantize(), torch.cat([p.dequantize() for p in tensor_scaled]))
    blocks = [_kept_blocks(32, 64, seed=seed) for seed in range(2)]
    assert torch.equal(cat_fp8_rows(blocks).dequantize(), torch.cat([p.dequantize() for p in blocks]))
    with pytest.raises(ValueError, match="quantized differently"):
        cat_fp8_rows([blocks[0], tensor_scaled[0]])


# --- online quantization and activations ------------------------------------------------------------------

def test_online_fp8_scales_each_output_channel_by_its_absmax():
    weight = _weight()
    kept = quantize_fp8_weight(weight)
    assert kept.scales.shape == (48, 1) and kept.scales[3].item() == 1.0
    assert torch.equal(kept.weight.float().abs().amax(dim=1)[torch.arange(48) != 3], torch.full((47,), E4M3_MAX))
    # e4m3's 3 mantissa bits: within half a step, 2^-4 of the value, of each weight
    assert ((kept.dequantize() - weight).abs() <= weight.abs() / 16 + 1e-6).all()


def test_activations_are_quantized_per_token_per_group_or_by_the_static_scale():
    x = torch.randn(5, 64) * torch.arange(1, 6).unsqueeze(1)
    x[2] = 0
    values, scales = quantize_fp8_activation(x)
    assert values.dtype == torch.float8_e4m3fn and scales.shape == (5, 1) and scales[2].item() == 1.0
    assert torch.equal(scales[[0, 1, 3, 4]].flatten(), x[[0, 1, 3, 4]].abs().amax(dim=1) / E4M3_MAX)
    assert torch.equal(values.float(), (x / scales).to(torch.float8_e4m3fn).float())
    values, scales = quantize_fp8_activation(x, group_size=16)
    assert scales.shape == (5, 4)
    assert torch.equal(scales[0], x[0].view(4, 16).abs().amax(dim=1) / E4M3_MAX)
    values, scales = quantize_fp8_activation(x * 1000, input_scale=torch.tensor([[2.0]]))
    assert torch.equal(scales, torch.full((5, 1), 2.0)) and values.float().abs().max() == E4M3_MAX  # clamped


def test_online_fp8_on_the_cpu_is_refused_naming_int8(tiny_model):
    with pytest.raises(ValueError, match="compute capability 8.9 .* on the CPU use quantization='int8'"):
        EngineConfig(model=tiny_model, quantization="fp8", device="cpu").validate(load_hf_config(tiny_model))


# --- loading ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fp8_checkpoint(tiny_model, tmp_path_factory) -> str:
    """The tiny model as a Qwen-style "fp8" checkpoint with 16 x 16 blocks (its k/v are 48 rows a rank at tp 2)."""
    out_dir = str(tmp_path_factory.mktemp("fp8_blocks"))
    state = {}
    for name, tensor in _read_checkpoint(tiny_model).items():
        module = name.rpartition(".")[0]
        if name.endswith(".weight") and QUANTIZED_LINEAR.match(module):
            state.update({f"{module}.{suffix}": value for suffix, value in block_fp8(tensor, (16, 16)).items()})
        else:
            state[name] = tensor
    _copy_with_config(tiny_model, out_dir, state, lambda config: config.update(quantization_config=QWEN_FP8))
    return out_dir


def _loaded(path: str, rank: int, size: int, keep_fp8: bool, online=None) -> dict[str, object]:
    """Each parameter on one rank (a stand-in group: nothing runs): its joined Fp8Weight, or its float tensor."""
    config = load_hf_config(path)
    with building_model_for(TensorParallelGroup(rank, size, process_group=object())):
        model = model_class(config)(config, make_backend("torch"))
    load_model(model, path, quantization_config_of(config), online, keep_fp8=keep_fp8)
    return {name: packed_quantized(param, lambda whole, dtype: whole) or param.data.clone()
            for name, param in model.named_parameters()}


def _linear_weights(path: str, rank: int, size: int, keep_fp8: bool) -> dict[str, object]:
    return {name: weight for name, weight in _loaded(path, rank, size, keep_fp8).items()
            if QUANTIZED_LINEAR.match(name.rpartition(".")[0])}


@pytest.mark.parametrize("tp", [1, 2])
def test_an_fp8_checkpoint_loads_kept_shards_equal_to_the_cpu_s_float_shards(fp8_checkpoint, tp):
    for rank in range(tp):
        kept, floats = _linear_weights(fp8_checkpoint, rank, tp, True), _linear_weights(fp8_checkpoint, rank, tp, False)
        assert kept.keys() == floats.keys() and any("qkv_proj" in name for name in kept)
        for name, weight in kept.items():
            assert isinstance(weight, Fp8Weight) and weight.block_size == (16, 16), name
            assert torch.equal(weight.dequantize(floats[name].dtype), floats[name]), name


def test_an_fp8_checkpoint_whose_blocks_a_rank_would_split_is_refused(fp8_checkpoint, tmp_path):
    with open(os.path.join(fp8_checkpoint, "config.json")) as f:
        config = json.load(f)
    state = _read_checkpoint(fp8_checkpoint)
    for name in [n for n in state if n.endswith(".weight_scale_inv")]:  # the same values as 32 x 32 blocks
        module = name.rpartition(".")[0]
        state.update({f"{module}.{suffix}": value for suffix, value in
                      block_fp8(state[f"{module}.weight"].float() * 1.0, (32, 32)).items()})
    _copy_with_config(fp8_checkpoint, str(tmp_path), state,
                      lambda c: c.update(quantization_config={**config["quantization_config"],
                                                              "weight_block_size": [32, 32]}))
    with pytest.raises(ValueError, match="not a multiple of the block's 32 rows"):
        _linear_weights(str(tmp_path), 0, 2, True)


def test_online_fp8_quantizes_every_linear_but_leaves_embedding_head_and_norms_float(tiny_model):
    online = OnlineQuantization(8, None, "fp8", lm_head=False, fp8=True)  # what the runner builds on sm_89+
    floats = _loaded(tiny_model, 0, 1, False)
    for name, weight in _loaded(tiny_model, 0, 1, False, online).items():
        if QUANTIZED_LINEAR.match(name.rpartition(".")[0]) and name.endswith(".weight"):
            assert isinstance(weight, Fp8Weight) and weight.scales.shape == (weight.shape[0], 1), name
            assert torch.equal(weight.dequantize(), quantize_fp8_weight(floats[name]).dequantize()), name
        else:
            assert torch.equal(weight, floats[name]), name


def test_online_fp8_where_the_platform_has_no_fp8_matmul_is_refused_naming_int8():
    from tpengine.platforms import cpu
    with pytest.raises(ValueError, match="on this cpu device use quantization='int8'"):
        online_quantization(EngineConfig(model="unused", quantization="fp8"), cpu, torch.device("cpu"))
