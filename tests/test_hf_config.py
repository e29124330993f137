"""config.json read with json gives, for every field the engine, runner and models read, what transformers'
AutoConfig gives: for configs transformers wrote, for the same configs with keys missing (each family's
defaults), and for transformers 4's key names; a config it cannot read is a ValueError naming file and field."""
import dataclasses
import json
import os

import pytest
from transformers import (AutoConfig, DeepseekV2Config, DeepseekV3Config, Gemma2Config, Gemma3Config, Gemma3TextConfig, GptOssConfig, LlamaConfig,
                          MistralConfig, Phi3Config, Qwen2_5_VLConfig, Qwen2_5_VLTextConfig, Qwen2Config, Qwen3Config,
                          Qwen3MoeConfig, Qwen3VLConfig, Qwen3VLMoeConfig, Qwen3VLMoeTextConfig, Qwen3VLTextConfig)

from tests.models.deepseek import DEEPSEEK_V2_GROUPS, DEEPSEEK_V2_LITE, DEEPSEEK_V3
from tests.models.gpt_oss import GPT_OSS_MODEL
from tests.models.moe import MOE_MODEL
from tpengine.families import ARCHITECTURES, FAMILIES
from tpengine.hf_config import HFConfig, load_eos_token_ids, load_hf_config, parse_hf_config

SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2)
MOE = {k: v for k, v in MOE_MODEL.items() if k not in ("architecture", "with_tokenizer")}
GPT_OSS = {k: v for k, v in GPT_OSS_MODEL.items() if k not in ("architecture", "with_tokenizer")}
YARN = dict(rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=64)
LLAMA3 = dict(rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=64)
GEMMA3_ROPE = {"full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1e6),
               "sliding_attention": dict(rope_type="default", rope_theta=1e4)}
GEMMA3_TEXT = dict(SMALL, head_dim=32, sliding_window=64, query_pre_attn_scalar=32, rope_parameters=GEMMA3_ROPE,
                   final_logit_softcapping=30.0, layer_types=["sliding_attention", "full_attention"] * 2)
TINY_VISION = dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                   num_attention_heads=2, image_size=28, patch_size=14)


def longrope(num_frequencies: int, **settings) -> dict:
    return dict(rope_type="longrope", rope_theta=1e4, short_factor=[1.0 + i for i in range(num_frequencies)],
                long_factor=[4.0 + i for i in range(num_frequencies)], **settings)


def _settings(model: dict) -> dict:
    """A test checkpoint's config settings, without the writer's own keys."""
    return {k: v for k, v in model.items() if k not in ("architecture", "with_tokenizer")}


# (architecture, config class, settings): each family's non-defaults where our code reads them
WRITTEN = {
    "qwen3": ("Qwen3ForCausalLM", Qwen3Config, dict(SMALL, head_dim=48, tie_word_embeddings=True, rms_norm_eps=1e-5,
                                                    attention_bias=True, bos_token_id=7, eos_token_id=[5, 6],
                                                    dtype="bfloat16")),
    "qwen3_window": ("Qwen3ForCausalLM", Qwen3Config, dict(SMALL, use_sliding_window=True, sliding_window=32,
                                                           max_window_layers=2, rope_parameters=YARN)),
    "qwen2": ("Qwen2ForCausalLM", Qwen2Config, dict(SMALL, head_dim=32, rope_parameters=YARN, max_position_embeddings=64)),
    "qwen2_window": ("Qwen2ForCausalLM", Qwen2Config, dict(SMALL, use_sliding_window=True, sliding_window=64,
                                                           max_window_layers=1, tie_word_embeddings=True)),
    "llama": ("LlamaForCausalLM", LlamaConfig, dict(SMALL, attention_bias=True, mlp_bias=True, rope_parameters=LLAMA3)),
    "llama_tied": ("LlamaForCausalLM", LlamaConfig, dict(SMALL, hidden_size=96, num_attention_heads=3,
                                                         num_key_value_heads=1, tie_word_embeddings=True,
                                                         eos_token_id=[1, 2], dtype="float16")),
    "mistral": ("MistralForCausalLM", MistralConfig, dict(SMALL, sliding_window=None,
                                                          rope_parameters=dict(rope_type="linear", factor=2.0))),
    "mistral_window": ("MistralForCausalLM", MistralConfig, dict(SMALL, sliding_window=48, head_dim=24)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", Qwen3MoeConfig, MOE),
    "qwen3_moe_stepped": ("Qwen3MoeForCausalLM", Qwen3MoeConfig,
                          dict(MOE, norm_topk_prob=False, mlp_only_layers=[], decoder_sparse_step=2,
                               use_sliding_window=True, sliding_window=16)),
    "gemma2": ("Gemma2ForCausalLM", Gemma2Config, dict(SMALL, head_dim=16, sliding_window=32, query_pre_attn_scalar=24,
                                                       attn_logit_softcapping=20.0, final_logit_softcapping=10.0,
                                                       tie_word_embeddings=False, eos_token_id=[1, 107])),
    "gemma2_no_caps": ("Gemma2ForCausalLM", Gemma2Config, dict(SMALL, attn_logit_softcapping=None,
                                                               final_logit_softcapping=None, attention_bias=True)),
    "gemma3_text": ("Gemma3ForCausalLM", Gemma3TextConfig, GEMMA3_TEXT),
    "gemma3_pattern": ("Gemma3ForCausalLM", Gemma3TextConfig, dict(SMALL, num_hidden_layers=7,
                                                                   sliding_window_pattern=3)),
    "gemma3": ("Gemma3ForConditionalGeneration", Gemma3Config,
               dict(text_config=dict(GEMMA3_TEXT, model_type="gemma3_text"), vision_config=TINY_VISION,
                    tie_word_embeddings=False, dtype="bfloat16", eos_token_id=[1, 106])),
    # Phi-3-mini-4k: a window in every layer; Phi-3.5: LongRoPE (factor from the two windows, or given); Phi-4-mini:
    # partial rotary, tied head
    "phi3": ("Phi3ForCausalLM", Phi3Config, dict(SMALL, sliding_window=32, rms_norm_eps=1e-6, bos_token_id=7,
                                                 eos_token_id=[5, 6], dtype="bfloat16")),
    "phi3_longrope": ("Phi3ForCausalLM", Phi3Config, dict(SMALL, rope_parameters=longrope(8),
                                                          original_max_position_embeddings=64,
                                                          max_position_embeddings=256)),
    "phi3_longrope_factors": ("Phi3ForCausalLM", Phi3Config,
                              dict(SMALL, rope_parameters=longrope(8, factor=8.0, attention_factor=1.25),
                                   original_max_position_embeddings=32)),
    "phi4_mini": ("Phi3ForCausalLM", Phi3Config, dict(SMALL, partial_rotary_factor=0.75, tie_word_embeddings=True,
                                                      rope_parameters=longrope(6),
                                                      original_max_position_embeddings=64)),
    "gpt_oss": ("GptOssForCausalLM", GptOssConfig, GPT_OSS),
    "gpt_oss_layers": ("GptOssForCausalLM", GptOssConfig,
                       dict(SMALL, num_local_experts=8, num_experts_per_tok=2, attention_bias=False, head_dim=24,
                            layer_types=["full_attention", "sliding_attention"] * 2, sliding_window=None,
                            rope_parameters=dict(rope_type="default", rope_theta=5e5), hidden_act="gelu")),
    "deepseek_v2_lite": ("DeepseekV2ForCausalLM", DeepseekV2Config, _settings(DEEPSEEK_V2_LITE)),
    "deepseek_v2": ("DeepseekV2ForCausalLM", DeepseekV2Config, _settings(DEEPSEEK_V2_GROUPS)),
    "deepseek_v3": ("DeepseekV3ForCausalLM", DeepseekV3Config,
                    dict(_settings(DEEPSEEK_V3), rope_parameters=dict(YARN, mscale=1.0, mscale_all_dim=0.8))),
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", Qwen2_5_VLConfig,
                   dict(text_config=dict(SMALL, model_type="qwen2_5_vl_text", rope_parameters=dict(
                       rope_type="default", rope_theta=5e5, mrope_section=[4, 6, 6])),
                        vision_config=dict(depth=2, hidden_size=32, num_heads=2, out_hidden_size=64),
                        image_token_id=11, video_token_id=12, vision_start_token_id=13, vision_end_token_id=14,
                        dtype="bfloat16")),
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", Qwen3VLConfig,
                 dict(text_config=dict(SMALL, model_type="qwen3_vl_text", head_dim=24, rope_parameters=dict(
                     rope_type="default", rope_theta=5e5, mrope_section=[4, 4, 4], mrope_interleaved=True)),
                      vision_config=dict(depth=2, hidden_size=32, num_heads=2, out_hidden_size=64,
                                         deepstack_visual_indexes=[0]),
                      image_token_id=11, tie_word_embeddings=True)),
    "qwen3_vl_moe": ("Qwen3VLMoeForConditionalGeneration", Qwen3VLMoeConfig,
                     dict(text_config=dict(SMALL, model_type="qwen3_vl_moe_text", head_dim=24, num_experts=8,
                                           num_experts_per_tok=3, moe_intermediate_size=32, decoder_sparse_step=2,
                                           mlp_only_layers=[3], rope_parameters=dict(
                                               rope_type="default", rope_theta=5e5, mrope_section=[4, 4, 4],
                                               mrope_interleaved=True)),
                          vision_config=dict(depth=2, hidden_size=32, num_heads=2, out_hidden_size=64,
                                             deepstack_visual_indexes=[0]),
                          image_token_id=11, tie_word_embeddings=True)),
}
# an image-text config's own fields beside its text_config (vision_config compared key by key)
VISION_FIELDS = ("vision_config", "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
                 "boi_token_id", "eoi_token_id", "mm_tokens_per_image")
# a Gemma3ForConditionalGeneration config's own fields (its token ids too, where it has them); its text model's
# are its text_config's
OUTER_FIELDS = ("model_type", "architectures", "dtype", "tie_word_embeddings", "quantization_config")
OUTER_TOKEN_IDS = ("bos_token_id", "eos_token_id")
# the per-layer-type rope of Gemma 3, which transformers 4 spelled rope_theta, rope_local_base_freq and rope_scaling
FLAT_ROPE = [name for name in WRITTEN if not name.startswith(("gemma3", "qwen2_5_vl", "qwen3_vl"))]


# (model_type, our field) -> the attribute its config class gives it under another name
THEIR_NAMES = {("deepseek_v3", "num_experts"): "n_routed_experts"}


def absent(field: dataclasses.Field):
    """What our code takes for a field the transformers config does not have (every family's class has the
    fields without a default)."""
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    raise AttributeError(field.name)


def transformers_value(config, field: dataclasses.Field, ours: HFConfig):
    if config.model_type in ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "gemma3") and field.name in VISION_FIELDS:
        value = getattr(config, field.name, absent(field))  # Gemma 3's token ids through its attribute_map
        return {k: v for k, v in value.to_dict().items() if k in ours.vision_config} if field.name == "vision_config" \
            else value
    if config.model_type in ("gemma3", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe") and not (
            field.name in OUTER_FIELDS or field.name in OUTER_TOKEN_IDS and hasattr(config, field.name)):
        config = config.get_text_config()
    name = THEIR_NAMES.get((config.model_type, field.name), field.name)
    value = getattr(config, name) if hasattr(config, name) else absent(field)
    if field.name == "dtype" and value is not None:  # a torch.dtype there, its name here
        return str(value).removeprefix("torch.")
    return value


def mismatches(path: str) -> list[str]:
    """Fields where our reading of path's config.json differs from AutoConfig's; a config one refuses the
    other must refuse too."""
    try:
        theirs = AutoConfig.from_pretrained(path)
    except Exception:  # noqa: BLE001: transformers' strict validation raises its own types
        with pytest.raises(ValueError):
            load_hf_config(path)
        return []
    ours = load_hf_config(path)
    return [f"{f.name}: ours {getattr(ours, f.name)!r}, transformers {transformers_value(theirs, f, ours)!r}"
            for f in dataclasses.fields(HFConfig) if getattr(ours, f.name) != transformers_value(theirs, f, ours)]


def write_config(directory, name: str) -> tuple[str, dict]:
    architecture, config_class, settings = WRITTEN[name]
    path = str(directory / name)
    config_class(architectures=[architecture], **settings).save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        return path, json.load(f)


def rewrite(path: str, raw: dict) -> str:
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f)
    return path


@pytest.mark.parametrize("name", list(WRITTEN))
def test_a_config_transformers_wrote_reads_as_transformers_reads_it(name, tmp_path):
    path, _ = write_config(tmp_path, name)
    assert mismatches(path) == []


# keys whose default leaves a config transformers reads but cannot run ("every key": all of them missing): refused
# by name here. DeepSeek: V2's num_experts_per_tok defaults to None, its group-limited routing has no default
# groups, and a default qk_rope_head_dim (64) disagrees with the head_dim written beside it.
REFUSED_WITHOUT = {"deepseek_v2_lite": {"num_experts_per_tok", "qk_rope_head_dim", "every key"},
                   "deepseek_v2": {"num_experts_per_tok", "qk_rope_head_dim", "n_group", "topk_group", "every key"},
                   "deepseek_v3": {"qk_rope_head_dim"},
                   # Qwen2_5_VLTextConfig's 64 heads over the written hidden size of 64: heads one dimension wide
                   "qwen2_5_vl": {"text_config.num_attention_heads"}}


def mismatches_or_refused(name: str, key: str, path: str) -> list[str]:
    if key not in REFUSED_WITHOUT.get(name, ()):
        return mismatches(path)
    with pytest.raises(ValueError):
        load_hf_config(path)
    return []


@pytest.mark.parametrize("name", list(WRITTEN))
def test_a_missing_key_takes_the_default_of_the_family_s_transformers_config(name, tmp_path):
    path, raw = write_config(tmp_path, name)
    found = {}
    for key in sorted(set(raw) - {"architectures", "model_type"}):
        found[key] = mismatches_or_refused(name, key, rewrite(path, {k: v for k, v in raw.items() if k != key}))
    for key in sorted(raw.get("rope_parameters") or ()):
        rope = {k: v for k, v in raw["rope_parameters"].items() if k != key}
        found[f"rope_parameters.{key}"] = mismatches(rewrite(path, {**raw, "rope_parameters": rope}))
        if isinstance(raw["rope_parameters"][key], dict):  # per layer type: each of its keys too
            for inner in sorted(raw["rope_parameters"][key]):
                rope = {**raw["rope_parameters"],
                        key: {k: v for k, v in raw["rope_parameters"][key].items() if k != inner}}
                found[f"rope_parameters.{key}.{inner}"] = mismatches(rewrite(path, {**raw, "rope_parameters": rope}))
    for key in sorted(raw.get("text_config") or ()):
        text = {k: v for k, v in raw["text_config"].items() if k != key}
        found[f"text_config.{key}"] = mismatches_or_refused(name, f"text_config.{key}",
                                                            rewrite(path, {**raw, "text_config": text}))
    found["every key"] = mismatches_or_refused(name, "every key",
                                               rewrite(path, {k: raw[k] for k in ("architectures", "model_type")}))
    assert {key: problems for key, problems in found.items() if problems} == {}


@pytest.mark.parametrize("name", FLAT_ROPE)
def test_transformers_4_key_names_read_as_transformers_reads_them(name, tmp_path):
    path, raw = write_config(tmp_path, name)
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope.pop("rope_theta")
    rope_type = rope.pop("rope_type")
    raw["rope_scaling"] = None if rope_type == "default" else {"type": rope_type, **rope}
    raw.pop("layer_types", None)  # transformers 4 before 4.53 wrote none
    if "dtype" in raw:
        raw["torch_dtype"] = raw.pop("dtype")
    if "num_local_experts" in raw:
        raw["num_experts"] = raw.pop("num_local_experts")
    assert mismatches(rewrite(path, raw)) == []


@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "linear", "factor": 8.0}])
@pytest.mark.parametrize("name", ["gemma3_text", "gemma3_pattern", "gemma3"])
def test_gemma3_transformers_4_rope_keys_read_as_transformers_reads_them(name, rope_scaling, tmp_path):
    path, raw = write_config(tmp_path, name)
    text = raw.get("text_config", raw)  # where the text model's keys are
    rope = text.pop("rope_parameters")
    text.update(rope_theta=rope["full_attention"]["rope_theta"], rope_scaling=rope_scaling,
                rope_local_base_freq=rope["sliding_attention"]["rope_theta"] / 2)
    text["sliding_window_pattern"] = text.pop("layer_types").index("full_attention") + 1
    assert mismatches(rewrite(path, raw)) == []
    for key in ("rope_theta", "rope_local_base_freq"):  # each missing one takes Gemma3TextConfig's default
        value = text.pop(key)
        assert mismatches(rewrite(path, raw)) == [], key
        text[key] = value


def test_every_supported_architecture_has_a_family():
    model_types = {Qwen3Config.model_type, Qwen2Config.model_type, LlamaConfig.model_type, MistralConfig.model_type,
                   Qwen3MoeConfig.model_type, Gemma2Config.model_type, Gemma3TextConfig.model_type,
                   Gemma3Config.model_type, Phi3Config.model_type, GptOssConfig.model_type,
                   DeepseekV2Config.model_type, DeepseekV3Config.model_type, Qwen2_5_VLConfig.model_type,
                   Qwen2_5_VLTextConfig.model_type, Qwen3VLConfig.model_type, Qwen3VLTextConfig.model_type,
                   Qwen3VLMoeConfig.model_type, Qwen3VLMoeTextConfig.model_type}
    assert set(FAMILIES) == model_types and len(ARCHITECTURES) == len(model_types) - 3  # the VL models' text parts


@pytest.mark.parametrize("settings, message", [
    ({"hidden_size": "64"}, "hidden_size must be an integer >= 1, got '64'"),
    ({"num_attention_heads": True}, "num_attention_heads must be an integer >= 1, got True"),
    ({"tie_word_embeddings": 1}, "tie_word_embeddings must be true or false, got 1"),
    ({"sliding_window": 12.5}, "sliding_window must be an integer >= 1 or null, got 12.5"),
    ({"layer_types": ["full_attention"]}, "layer_types has 1 entries, not num_hidden_layers=4"),
    ({"rope_parameters": "yarn"}, "rope_parameters must be an object, got 'yarn'"),
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported; supported: qwen3, qwen2, llama, mistral, qwen3_moe, "
                                    "gemma2, gemma3_text, gemma3, qwen2_5_vl_text, qwen2_5_vl, qwen3_vl_text, qwen3_vl, phi3, "
                                    "gpt_oss"),
    ({"model_type": None}, "it has no model_type"),
])
def test_a_field_of_the_wrong_kind_is_a_value_error_naming_the_file_and_the_field(settings, message, tmp_path):
    path, raw = write_config(tmp_path, "qwen3")
    rewrite(path, {**raw, **settings})
    with pytest.raises(ValueError, match=f"{os.path.join(path, 'config.json')} is not a valid model config: "
                                         + message.replace("[", r"\[").replace("(", r"\(")):
        load_hf_config(path)


def test_generation_config_eos_ids_come_first_and_a_broken_one_is_named(tmp_path):
    path, raw = write_config(tmp_path, "llama_tied")
    config = load_hf_config(path)
    assert load_eos_token_ids(path, config) == {1, 2}  # no generation_config.json: config.json's
    generation = os.path.join(path, "generation_config.json")
    for content, expected in [({"eos_token_id": [7, 8, 9]}, {7, 8, 9}), ({"eos_token_id": 3}, {3}),
                              ({"bos_token_id": 1}, {1, 2})]:
        with open(generation, "w") as f:
            json.dump(content, f)
        assert load_eos_token_ids(path, config) == expected
    with open(generation, "w") as f:
        f.write('{"eos_token_id": ')
    with pytest.raises(ValueError, match="generation_config.json is not a valid model config"):
        load_eos_token_ids(path, config)


def test_parse_reads_a_dict_as_load_reads_the_file(tmp_path):
    path, raw = write_config(tmp_path, "qwen3_moe")
    assert parse_hf_config(raw, "config.json") == load_hf_config(path)
