"""A compressed-tensors checkpoint's kv_cache_scheme: FP8 per tensor is read (its k/v_proj.output_scale tensors are
each layer's KV-cache scales for kv_cache_dtype="fp8"); any other scheme is refused by name."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.quantization.checkpoints import CheckpointFormat, quantization_config, write_quantized_checkpoint
from tpengine import LLM
from tpengine.quantization.config import QuantizationConfig

# what llm-compressor writes for an FP8 KV cache with static per-tensor scales
FP8_SCHEME = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "tensor",
              "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax"}
FP8_WEIGHTS = CheckpointFormat("float-quantized", bits=8, group_size=None)


def test_an_fp8_checkpoint_with_kv_cache_scales_loads_them_into_each_layer(tiny_model, tmp_path):
    path = str(tmp_path / "fp8-kv")
    write_quantized_checkpoint(tiny_model, path, FP8_WEIGHTS)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"]["kv_cache_scheme"] = FP8_SCHEME
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    scales = {0: (0.02, 0.03), 1: (0.04, 0.05)}
    for layer, (k_scale, v_scale) in scales.items():
        tensors[f"model.layers.{layer}.self_attn.k_proj.output_scale"] = torch.tensor([k_scale])
        tensors[f"model.layers.{layer}.self_attn.v_proj.output_scale"] = torch.tensor([v_scale])
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with LLM(path, kvcache_block_size=16, num_kvcache_blocks=4, kv_cache_dtype="fp8") as llm:
        layers = llm.executor.runner.attention_layers
        loaded = [scale.item() for layer in layers for scale in (layer.k_scale, layer.v_scale)]
    assert loaded == pytest.approx([0.02, 0.03, 0.04, 0.05])


def test_a_nan_kv_cache_scale_is_a_value_error_naming_it(tiny_model, tmp_path):
    path = str(tmp_path / "fp8-kv")
    write_quantized_checkpoint(tiny_model, path, FP8_WEIGHTS)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    tensors["model.layers.1.self_attn.v_proj.output_scale"] = torch.tensor([float("nan")])
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.v_proj.output_scale has 1 non-finite values"):
        LLM(path, kvcache_block_size=16, num_kvcache_blocks=4, kv_cache_dtype="fp8")


@pytest.mark.parametrize("change, shown", [
    (dict(strategy="attn_head"), "'strategy': 'attn_head'"),  # a scale per KV head
    (dict(type="int"), "'type': 'int'"),
    (dict(dynamic=True), "'dynamic': True"),
], ids=["per_head", "int8", "dynamic"])
def test_other_kv_cache_schemes_are_refused_naming_what_is_read(change, shown):
    config = {**quantization_config(FP8_WEIGHTS), "kv_cache_scheme": {**FP8_SCHEME, **change}}
    with pytest.raises(ValueError, match=r"kv_cache_scheme is not supported unless .*'float'.*got .*" + shown):
        QuantizationConfig.from_hf(config)
