"""A checkpoint that cannot fill the model is a ValueError naming what is wrong, at every tensor-parallel
size, with no process or segment left behind."""
import os
import shutil

import pytest
from safetensors.torch import load_file, save_file

from tests.leftovers import assert_nothing_left, snapshot
from tpengine import LLM

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
