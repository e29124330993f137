"""PEFT adapters made by peft itself read back as peft holds them: each module's A, B and scale (alpha / r, rsLoRA,
rank_pattern and alpha_pattern), from .safetensors and .bin, Phi-3's fused projections included; every variant
whose math differs from y += scale * B A x is refused with a ValueError naming it."""
import json
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.lora.adapters import ATTENTION, MLP, PHI3_FUSED, load_peft_model, make_peft_adapter, write_tiny_base
from tpengine.lora.adapter import (SUPPORTED_MODULES, UNSUPPORTED_SETTINGS, AdapterConfig, adapter_files,
                                   adapter_shapes, read_adapter_config, read_adapter_weights)

PEFT_PREFIX = "base_model.model."


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    return write_tiny_base(str(tmp_path_factory.mktemp("qwen3_base")))


@pytest.fixture(scope="module")
def adapter(base, tmp_path_factory) -> str:
    """q and v only, r 8, alpha 16."""
    return make_peft_adapter(base, str(tmp_path_factory.mktemp("adapter")), targets=("q_proj", "v_proj"))


def edited_copy(adapter: str, folder, **settings) -> str:
    """A copy of adapter whose adapter_config.json has settings changed."""
    path = str(folder / "edited")
    shutil.copytree(adapter, path)
    config_file = os.path.join(path, "adapter_config.json")
    with open(config_file) as f:
        config = json.load(f)
    with open(config_file, "w") as f:
        json.dump({**config, **settings}, f)
    return path


def with_weights(adapter: str, folder, tensors: dict[str, torch.Tensor]) -> str:
    """A copy of adapter whose weights file holds tensors instead."""
    path = str(folder / "reweighted")
    shutil.copytree(adapter, path)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    return path


def peft_state_dict(base: str, adapter: str) -> dict[str, torch.Tensor]:
    """peft's own view of the adapter's weights, keyed as ours are: the base model's module paths."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(load_peft_model(base, adapter))
    return {key[len(PEFT_PREFIX):]: tensor for key, tensor in state.items()}


def peft_modules(base: str, adapter: str) -> dict[str, torch.nn.Module]:
    """peft's LoRA layers by the base model's module path."""
    from peft.tuners.lora import LoraLayer

    model = load_peft_model(base, adapter)
    return {name[len(PEFT_PREFIX):]: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}


# ---- the config


def test_config_gives_rank_targets_and_alpha_over_r(adapter):
    config = read_adapter_config(adapter, max_lora_rank=8)
    assert (config.rank, config.target_modules) == (8, ("q_proj", "v_proj"))
    assert config.scale_of("model.layers.0.self_attn.q_proj") == 16 / 8


def test_rslora_scale_is_alpha_over_the_square_root_of_r(base, tmp_path):
    path = make_peft_adapter(base, str(tmp_path), r=16, alpha=8, targets=("q_proj",), use_rslora=True)
    config = read_adapter_config(path, max_lora_rank=16)
    assert config.use_rslora and config.scale_of("model.layers.1.self_attn.q_proj") == 8 / math.sqrt(16)


def test_rank_and_alpha_patterns_give_every_module_peft_s_rank_and_scale(base, tmp_path):
    path = make_peft_adapter(base, str(tmp_path), r=8, alpha=16, targets=ATTENTION + MLP,
                             rank_pattern={"layers.0.self_attn.q_proj": 4, "down_proj": 12},
                             alpha_pattern={r"layers\.1\..*_proj": 5, "v_proj": 3})
    config = read_adapter_config(path, max_lora_rank=12)
    assert config.rank == 12  # the largest, from the rank_pattern
    modules = peft_modules(base, path)
    assert sorted(modules) == sorted(read_adapter_weights(path, config))
    for module_path, module in modules.items():
        assert config.rank_of(module_path) == module.r["default"], module_path
        assert config.scale_of(module_path) == pytest.approx(module.scaling["default"], rel=1e-12), module_path
    assert {config.scale_of(p) for p in modules} == {16 / 8, 16 / 4, 16 / 12, 3 / 8, 5 / 8, 5 / 12}


def test_all_linear_targets_come_from_the_weights(base, tmp_path):
    config = read_adapter_config(make_peft_adapter(base, str(tmp_path), targets="all-linear"), max_lora_rank=8)
    assert config.target_modules == ATTENTION + MLP


def test_regex_targets_come_from_the_weights(base, tmp_path):
    path = make_peft_adapter(base, str(tmp_path), targets=r".*\.layers\.1\.self_attn\.(k|o)_proj")
    config = read_adapter_config(path, max_lora_rank=8)
    assert config.target_modules == ("k_proj", "o_proj")
    assert sorted(read_adapter_weights(path, config)) == ["model.layers.1.self_attn.k_proj",
                                                          "model.layers.1.self_attn.o_proj"]


def test_config_survives_msgspec_and_is_hashable(base, tmp_path):
    import msgspec

    path = make_peft_adapter(base, str(tmp_path), rank_pattern={"q_proj": 2}, alpha_pattern={"k_proj": 3})
    config = read_adapter_config(path, max_lora_rank=8)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(config), type=AdapterConfig) == config
    hash(config)


# ---- the weights


@pytest.mark.parametrize("safe_serialization", [True, False], ids=["safetensors", "bin"])
def test_weights_equal_peft_s_state_dict(base, tmp_path, safe_serialization):
    path = make_peft_adapter(base, str(tmp_path), r=4, alpha=8, targets=ATTENTION + MLP, seed=3,
                             safe_serialization=safe_serialization)
    assert adapter_files(path).endswith(".safetensors" if safe_serialization else ".bin")
    config = read_adapter_config(path, max_lora_rank=8)
    weights = read_adapter_weights(path, config)
    expected = peft_state_dict(base, path)
    assert len(weights) == 2 * 7 and 2 * len(weights) == len(expected)
    for module_path, (lora_a, lora_b, scale) in weights.items():
        assert lora_a.dtype == lora_b.dtype == torch.float32 and scale == 2.0
        assert torch.equal(lora_a, expected[f"{module_path}.lora_A.weight"])
        assert torch.equal(lora_b, expected[f"{module_path}.lora_B.weight"])
        assert lora_a.shape[0] == lora_b.shape[1] == 4 and lora_b.abs().sum() > 0  # B drawn, not peft's zeros
    assert weights["model.layers.0.mlp.down_proj"][0].shape == (4, 128)
    assert weights["model.layers.0.self_attn.k_proj"][1].shape == (2 * 16, 4)


@pytest.mark.parametrize("safe_serialization", [True, False], ids=["safetensors", "bin"])
def test_adapter_shapes_are_the_weights_shapes(base, tmp_path, safe_serialization):
    path = make_peft_adapter(base, str(tmp_path), r=4, targets=("k_proj", "down_proj"),
                             safe_serialization=safe_serialization)
    config = read_adapter_config(path, max_lora_rank=8)
    weights = read_adapter_weights(path, config)
    assert adapter_shapes(path, config) == {module: (tuple(a.shape), tuple(b.shape))
                                            for module, (a, b, _) in weights.items()}
    assert adapter_shapes(path, config)["model.layers.1.mlp.down_proj"] == ((4, 128), (64, 4))


def test_adapters_are_deterministic_by_seed(base, tmp_path):
    def weights(seed, name):
        path = make_peft_adapter(base, str(tmp_path / name), seed=seed, targets=("o_proj",))
        return load_file(adapter_files(path))
    first, again, other = weights(1, "first"), weights(1, "again"), weights(2, "other")
    assert all(torch.equal(first[key], again[key]) for key in first)
    assert not torch.equal(first[next(iter(first))], other[next(iter(other))])


def test_half_precision_weights_read_as_float32(adapter, tmp_path):
    tensors = {key: t.to(torch.bfloat16) for key, t in load_file(adapter_files(adapter)).items()}
    path = with_weights(adapter, tmp_path, tensors)
    lora_a, lora_b, _ = read_adapter_weights(path, read_adapter_config(path, 8))["model.layers.0.self_attn.q_proj"]
    assert lora_a.dtype == lora_b.dtype == torch.float32
    assert torch.equal(lora_a, tensors[f"{PEFT_PREFIX}model.layers.0.self_attn.q_proj.lora_A.weight"].float())


def test_safetensors_is_read_before_bin(adapter, tmp_path):
    path = str(tmp_path / "both")
    shutil.copytree(adapter, path)
    open(os.path.join(path, "adapter_model.bin"), "wb").close()
    assert adapter_files(path) == os.path.join(path, "adapter_model.safetensors")


def test_phi3_fused_qkv_and_gate_up_are_read(tmp_path):
    base = write_tiny_base(str(tmp_path / "phi3"), architecture="Phi3ForCausalLM")
    path = make_peft_adapter(base, str(tmp_path / "adapter"), targets=PHI3_FUSED)
    config = read_adapter_config(path, max_lora_rank=8)
    assert config.target_modules == ("o_proj", "down_proj", "qkv_proj", "gate_up_proj")
    weights = read_adapter_weights(path, config)
    expected = peft_state_dict(base, path)
    lora_a, lora_b, _ = weights["model.layers.1.self_attn.qkv_proj"]
    assert lora_a.shape == (8, 64) and lora_b.shape == ((4 + 2 + 2) * 16, 8)  # q, k and v heads stacked
    assert weights["model.layers.0.mlp.gate_up_proj"][1].shape == (2 * 128, 8)
    assert torch.equal(lora_b, expected["model.layers.1.self_attn.qkv_proj.lora_B.weight"])


# ---- what is refused


def test_a_missing_folder_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no such folder"):
        read_adapter_config(str(tmp_path / "nowhere"), 16)


def test_a_folder_without_adapter_config_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no adapter_config.json"):
        read_adapter_config(str(tmp_path), 16)


def test_a_folder_without_weights_is_refused(adapter, tmp_path):
    path = str(tmp_path / "no_weights")
    shutil.copytree(adapter, path)
    os.remove(os.path.join(path, "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="neither adapter_model.safetensors nor adapter_model.bin"):
        read_adapter_config(path, 16)


def test_another_peft_type_is_refused(adapter, tmp_path):
    with pytest.raises(ValueError, match="peft_type is 'IA3'; only 'LORA'"):
        read_adapter_config(edited_copy(adapter, tmp_path, peft_type="IA3"), 16)


def test_a_rank_past_max_lora_rank_is_refused(base, tmp_path):
    path = make_peft_adapter(base, str(tmp_path), r=32, targets=("q_proj",))
    with pytest.raises(ValueError, match="adapter rank 32 is more than max_lora_rank=16"):
        read_adapter_config(path, max_lora_rank=16)


def test_a_rank_pattern_past_max_lora_rank_is_refused(base, tmp_path):
    path = make_peft_adapter(base, str(tmp_path), r=8, targets=("q_proj",),
                             rank_pattern={"layers.1.self_attn.q_proj": 24})
    with pytest.raises(ValueError, match=r"adapter rank 24 \(in its rank_pattern\) is more than max_lora_rank=16"):
        read_adapter_config(path, max_lora_rank=16)


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_SETTINGS))
def test_each_lora_variant_setting_is_refused(adapter, tmp_path, name):
    value = {"use_dora": True, "use_qalora": True, "lora_bias": True, "use_bdlora": {"nblocks": 2}}.get(name, [1])
    with pytest.raises(ValueError, match=rf"is not supported, got {name}="):
        read_adapter_config(edited_copy(adapter, tmp_path, **{name: value}), 16)


@pytest.mark.parametrize("bias", ["all", "lora_only"])
def test_a_trained_base_bias_is_refused(adapter, tmp_path, bias):
    with pytest.raises(ValueError, match=f"bias='{bias}' trains base biases"):
        read_adapter_config(edited_copy(adapter, tmp_path, bias=bias), 16)


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_4", "olora", "corda", "loftq"])
def test_an_unconverted_base_rewriting_init_is_refused(adapter, tmp_path, init):
    with pytest.raises(ValueError, match=f"init_lora_weights='{init}' rewrites the base weights"):
        read_adapter_config(edited_copy(adapter, tmp_path, init_lora_weights=init), 16)


@pytest.mark.parametrize("init", [True, False, "gaussian", "orthogonal", "eva", "mica"])
def test_plain_lora_inits_are_read(adapter, tmp_path, init):
    read_adapter_config(edited_copy(adapter, tmp_path, init_lora_weights=init, lora_dropout=0.3), 16)


@pytest.mark.parametrize("target", ["embed_tokens", "lm_head", "model.layers.0.mlp.experts", "mlp", "fc1"])
def test_an_unsupported_target_module_in_the_config_is_refused(adapter, tmp_path, target):
    with pytest.raises(ValueError, match=f"target_modules names '{target}'; supported are q_proj"):
        read_adapter_config(edited_copy(adapter, tmp_path, target_modules=["q_proj", target]), 16)


def test_peft_s_own_dora_adapter_is_refused_by_config_and_by_its_weights(base, tmp_path):
    path = make_peft_adapter(base, str(tmp_path / "dora"), targets=("q_proj",), use_dora=True)
    with pytest.raises(ValueError, match="DoRA"):
        read_adapter_config(path, 16)
    with pytest.raises(ValueError, match=r"q_proj\.lora_magnitude_vector is DoRA's magnitude vector"):
        read_adapter_config(edited_copy(path, tmp_path, use_dora=False), 16)


def test_peft_s_own_embedding_adapter_is_refused_by_config_and_by_its_weights(base, tmp_path):
    path = make_peft_adapter(base, str(tmp_path / "embedding"), targets=("q_proj", "embed_tokens"))
    with pytest.raises(ValueError, match="target_modules names 'embed_tokens'"):
        read_adapter_config(path, 16)
    regex_targets = edited_copy(path, tmp_path, target_modules=".*(q_proj|embed_tokens)")
    with pytest.raises(ValueError, match=r"embed_tokens\.base_layer\.weight is a copy of a base weight"):
        read_adapter_config(regex_targets, 16)
    lora_only = {k: t for k, t in load_file(adapter_files(path)).items() if ".base_layer." not in k}
    with pytest.raises(ValueError, match=r"embed_tokens\.lora_embedding_A is LoRA on an embedding"):
        read_adapter_config(with_weights(regex_targets, tmp_path, lora_only), 16)


def test_peft_s_own_lm_head_adapter_is_refused_by_its_weights(base, tmp_path):
    path = make_peft_adapter(base, str(tmp_path / "lm_head"), targets=r".*(q_proj|lm_head)")
    with pytest.raises(ValueError, match=r"lm_head\.base_layer\.weight is a copy of a base weight"):
        read_adapter_config(path, 16)
    lora_only = {k: t for k, t in load_file(adapter_files(path)).items() if ".base_layer." not in k}
    with pytest.raises(ValueError, match=r"lm_head\.lora_A\.weight adapts lm_head; supported are q_proj"):
        read_adapter_config(with_weights(path, tmp_path, lora_only), 16)


def test_peft_s_own_lora_bias_adapter_is_refused_by_config_and_by_its_weights(tmp_path):
    base = write_tiny_base(str(tmp_path / "biased"), attention_bias=True)
    path = make_peft_adapter(base, str(tmp_path / "adapter"), targets=("q_proj",), lora_bias=True)
    with pytest.raises(ValueError, match="lora_bias=True"):
        read_adapter_config(path, 16)
    with pytest.raises(ValueError, match=r"q_proj\.lora_B\.bias is a bias on LoRA B"):
        read_adapter_config(edited_copy(path, tmp_path, lora_bias=False), 16)


def test_peft_s_own_modules_to_save_adapter_is_refused(base, tmp_path):
    path = make_peft_adapter(base, str(tmp_path), targets=("q_proj",), modules_to_save=["lm_head"])
    with pytest.raises(ValueError, match="modules_to_save"):
        read_adapter_config(path, 16)


def test_an_a_without_its_b_is_refused_by_both_readers(adapter, tmp_path):
    key = f"{PEFT_PREFIX}model.layers.1.self_attn.v_proj.lora_B.weight"
    tensors = {k: t for k, t in load_file(adapter_files(adapter)).items() if k != key}
    path = with_weights(adapter, tmp_path, tensors)
    message = r"v_proj\.lora_A\.weight has no lora_B to go with it"
    with pytest.raises(ValueError, match=message):
        read_adapter_config(path, 16)
    config = AdapterConfig(rank=8, target_modules=("q_proj", "v_proj"), r=8, lora_alpha=16.0)
    with pytest.raises(ValueError, match=message):
        read_adapter_weights(path, config)


def test_a_pattern_that_is_not_a_regex_is_refused(adapter, tmp_path):
    with pytest.raises(ValueError, match=r"alpha_pattern key 'q_proj\(' is not a regex"):
        read_adapter_config(edited_copy(adapter, tmp_path, alpha_pattern={"q_proj(": 4}), 16)


def test_shapes_that_disagree_with_r_are_refused(adapter, tmp_path):
    with pytest.raises(ValueError, match=r"lora_A \[8, 64\] and lora_B \[64, 8\] disagree with its rank 4"):
        read_adapter_config(edited_copy(adapter, tmp_path, r=4), 16)


def test_a_key_that_is_not_a_lora_weight_is_refused(adapter, tmp_path):
    tensors = {**load_file(adapter_files(adapter)), f"{PEFT_PREFIX}lm_head.weight": torch.zeros(4, 4)}
    with pytest.raises(ValueError, match=r"base_model\.model\.lm_head\.weight is not a PEFT LoRA A or B weight"):
        read_adapter_config(with_weights(adapter, tmp_path, tensors), 16)


def test_weights_that_changed_since_the_config_was_read_are_refused(adapter, tmp_path):
    config = read_adapter_config(adapter, 16)
    tensors = {k: t for k, t in load_file(adapter_files(adapter)).items() if ".v_proj." not in k}
    with pytest.raises(ValueError, match=r"cover \('q_proj',\), not the \('q_proj', 'v_proj'\)"):
        read_adapter_weights(with_weights(adapter, tmp_path, tensors), config)


def test_the_supported_modules_are_the_dense_projections():
    assert SUPPORTED_MODULES == ATTENTION + MLP + ("qkv_proj", "gate_up_proj")
