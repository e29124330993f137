"""A checkpoint that cannot fill the model is a ValueError naming what is wrong, at every tensor-parallel
size, with no process or segment left behind; so is a quantized one with a NaN or Inf scale, or with a linear
stored float where its quantization_config quantizes it."""
import json
import os
import shutil

import pytest
from safetensors.torch import load_file, save_file

from tests.leftovers import assert_nothing_left, snapshot
from tests.quantization.checkpoints import CheckpointFormat, quantization_config, write_quantized_checkpoint
from tpengine import LLM, SamplingParams

ONE_TENSOR = "model.layers.1.mlp.down_proj.weight"


def _copy_with_tensors(tiny_model, tmp_path, change) -> str:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    tensors = load_file(os.path.join(tiny_model, "model.safetensors"))
    change(tensors)
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    return str(broken)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_missing_tensor_is_a_value_error_naming_it(tiny_model, tmp_path, tp):
    broken = _copy_with_tensors(tiny_model, tmp_path, lambda t: t.pop(ONE_TENSOR))
    before = snapshot()
    with pytest.raises(ValueError, match=f"lacks weights for.*{ONE_TENSOR}"):
        LLM(broken, tensor_parallel_size=tp, kvcache_block_size=16)
    assert_nothing_left(before)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_misshaped_tensor_is_a_value_error_naming_it_and_both_shapes(tiny_model, tmp_path, tp):
    # one row more than the model has: a shard of it would still copy without complaint
    def grow(tensors):
        weight = tensors[ONE_TENSOR]
        tensors[ONE_TENSOR] = weight.new_zeros(weight.size(0) + 1, weight.size(1))
    broken = _copy_with_tensors(tiny_model, tmp_path, grow)
    before = snapshot()
    with pytest.raises(ValueError, match=rf"checkpoint tensor '{ONE_TENSOR}'.*shape is \[65, 128\], "
                                         rf"the model expects \[64, 128\]"):
        LLM(broken, tensor_parallel_size=tp, kvcache_block_size=16)
    assert_nothing_left(before)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_truncated_safetensors_file_is_a_value_error_naming_it(tiny_model, tmp_path, tp):
    before = snapshot()
    broken = tmp_path / "truncated"
    shutil.copytree(tiny_model, broken)
    weights = broken / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match=r"model.safetensors is not a readable safetensors file"):
        LLM(broken, tensor_parallel_size=tp)
    assert_nothing_left(before)


def test_invalid_json_in_config_is_a_value_error_naming_the_file(tiny_model, tmp_path):
    broken = tmp_path / "bad_config"
    shutil.copytree(tiny_model, broken)
    (broken / "config.json").write_text('{"model_type": "qwen3", ')
    with pytest.raises(ValueError, match=r"config.json is not a valid model config"):
        LLM(broken)


def test_a_missing_part_of_a_packed_weight_is_a_value_error_naming_it(tiny_model, tmp_path):
    # q and v still fill qkv_proj's other rows: without the per-part check the engine would run on garbage
    broken = _copy_with_tensors(tiny_model, tmp_path, lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks weights for.*layers\.0\.self_attn\.qkv_proj\.weight.*'k'"):
        LLM(broken, kvcache_block_size=16)


# --- quantized checkpoints ----------------------------------------------------------------------------------

ONE_SCALE = "model.layers.1.self_attn.q_proj.scales"


@pytest.fixture(scope="module")
def gptq_model(tiny_model, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("gptq"))
    write_quantized_checkpoint(tiny_model, path, CheckpointFormat("gptq", group_size=32))
    return path


def _with_config(path: str, change) -> None:
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    change(config)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def _with_float_linears(quantized: str, float_dir: str, tmp_path, is_float) -> str:
    """The quantized checkpoint with the linears is_float names stored as the float checkpoint has them."""
    floats = load_file(os.path.join(float_dir, "model.safetensors"))

    def unquantize(tensors):
        for name in [n for n in tensors if is_float(n.rpartition(".")[0])]:
            del tensors[name]
        tensors.update({name: tensor for name, tensor in floats.items() if is_float(name.rpartition(".")[0])})
    return _copy_with_tensors(quantized, tmp_path, unquantize)


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("tp", [1, 2])
def test_a_non_finite_gptq_scale_is_a_value_error_naming_it(gptq_model, tmp_path, value, tp):
    def spoil(tensors):
        tensors[ONE_SCALE] = tensors[ONE_SCALE].clone()
        tensors[ONE_SCALE][0, :3] = value
    broken = _copy_with_tensors(gptq_model, tmp_path, spoil)
    before = snapshot()
    with pytest.raises(ValueError, match=rf"{ONE_SCALE} has 3 non-finite values \(NaN or Inf\): the checkpoint is "
                                         "corrupt"):
        LLM(broken, tensor_parallel_size=tp, kvcache_block_size=16)
    assert_nothing_left(before)


@pytest.mark.parametrize("config, marker", [
    (quantization_config(CheckpointFormat("gptq")), "qweight"),
    (quantization_config(CheckpointFormat("awq")), "qweight"),
    (quantization_config(CheckpointFormat("pack-quantized")), "weight_packed"),
    (quantization_config(CheckpointFormat("float-quantized")), "weight_scale"),
    ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16]},
     "weight_scale_inv"),
], ids=["gptq", "awq", "compressed-tensors", "compressed-tensors-fp8", "fp8"])
def test_a_quantization_config_over_float_weights_is_a_value_error_naming_a_missing_tensor(tiny_model, tmp_path,
                                                                                              config, marker):
    path = tmp_path / "float-with-config"
    shutil.copytree(tiny_model, path)
    _with_config(str(path), lambda hf_config: hf_config.update(quantization_config=config))
    with pytest.raises(ValueError, match=rf"checkpoint tensor '(model\.layers\.\d\.[\w.]+)\.weight' is float, but "
                                         rf"its {config['quant_method']} quantization_config quantizes '\1': the "
                                         rf"checkpoint lacks '\1\.{marker}'"):
        LLM(str(path), kvcache_block_size=16)


def test_one_linear_stored_float_in_a_gptq_checkpoint_is_a_value_error_naming_its_qweight(gptq_model, tiny_model,
                                                                                          tmp_path):
    broken = _with_float_linears(gptq_model, tiny_model, tmp_path, lambda module: module.endswith("1.mlp.up_proj"))
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' is float, but its gptq "
                                         r"quantization_config .* lacks 'model\.layers\.1\.mlp\.up_proj\.qweight'"):
        LLM(broken, kvcache_block_size=16)


def _generates(path: str) -> bool:
    with LLM(path, kvcache_block_size=16, num_kvcache_blocks=4) as llm:
        out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2, ignore_eos=True))[0]
    return len(out.token_ids) == 2 and out.finish_reason == "length"


@pytest.mark.parametrize("exclusion, is_float", [
    ({"dynamic": {r"-:.*\.layers\.1\..*": {}}}, lambda module: module.startswith("model.layers.1.")),
    ({"modules_in_block_to_quantize": [["self_attn.k_proj", "self_attn.v_proj", "self_attn.q_proj"],
                                       ["self_attn.o_proj"]]}, lambda module: ".mlp." in module),
    ({"modules_to_not_convert": ["mlp"]}, lambda module: ".mlp." in module),
], ids=["dynamic", "modules_in_block_to_quantize", "modules_to_not_convert"])
def test_gptq_linears_the_config_excludes_load_as_float(gptq_model, tiny_model, tmp_path, exclusion, is_float):
    path = _with_float_linears(gptq_model, tiny_model, tmp_path, is_float)
    _with_config(path, lambda config: config["quantization_config"].update(exclusion))
    assert _generates(path)


def test_compressed_tensors_linears_in_ignore_load_as_float(tiny_model, tmp_path):
    quantized = str(tmp_path / "quantized")
    write_quantized_checkpoint(tiny_model, quantized, CheckpointFormat("pack-quantized", group_size=32))
    path = _with_float_linears(quantized, tiny_model, tmp_path, lambda module: module.startswith("model.layers.0."))
    ignore = ["lm_head", r"re:model\.layers\.0\..*"]
    _with_config(path, lambda config: config["quantization_config"].update(ignore=ignore))
    assert _generates(path)
