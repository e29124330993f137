"""Checkpoints load however transformers wrote them: one file or sharded, v4 or v5 config keys."""
import json
import os

import pytest
import torch
from transformers import Qwen3ForCausalLM

from tests.conftest import TP_MODEL, hf_greedy, random_prompts
from tpengine import LLM, SamplingParams
from tpengine.hf_config import head_dim_of, parse_hf_config, rope_parameters_of


def test_sharded_checkpoint_with_index_loads_and_matches_transformers(tiny_model, tmp_path):
    sharded = str(tmp_path / "sharded")
    Qwen3ForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).save_pretrained(sharded, max_shard_size="100KB")
    with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
        assert len(set(json.load(f)["weight_map"].values())) > 1
    prompts = random_prompts(8, [6, 33], TP_MODEL["vocab_size"])
    with LLM(sharded, kvcache_block_size=16) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outputs] == hf_greedy(tiny_model, prompts, 8)


def test_rope_theta_from_transformers_4_and_5_configs():
    v4 = parse_hf_config({"model_type": "qwen3", "rope_theta": 5e5, "rope_scaling": None}, "config.json")
    v5 = parse_hf_config({"model_type": "qwen3", "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
                         "config.json")
    assert rope_parameters_of(v4).theta == 5e5
    assert rope_parameters_of(v5).theta == 1e6


def test_unsupported_rope_scaling_is_a_value_error():
    config = parse_hf_config({"model_type": "qwen3", "max_position_embeddings": 4096,
                              "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 4.0}},
                             "config.json")
    with pytest.raises(ValueError, match="rope type 'dynamic' is not supported"):
        rope_parameters_of(config)


def test_head_dim_defaults_to_hidden_over_heads():
    for model_type in ("qwen2", "qwen3_moe", "llama", "mistral"):  # qwen3 has its own default, 128
        config = {"model_type": model_type, "hidden_size": 256, "num_attention_heads": 8}
        assert head_dim_of(parse_hf_config(config, "config.json")) == 32
        assert head_dim_of(parse_hf_config({**config, "head_dim": 48}, "config.json")) == 48


def test_missing_weights_are_a_value_error(tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in os.listdir(tiny_model):
        if not name.endswith(".safetensors"):
            (broken / name).write_bytes(open(os.path.join(tiny_model, name), "rb").read())
    tensors = load_file(os.path.join(tiny_model, "model.safetensors"))
    del tensors["model.norm.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks weights for.*model.norm.weight"):
        LLM(str(broken))


def copy_checkpoint_config(source: str, target) -> None:
    target.mkdir()
    for name in os.listdir(source):
        if not name.endswith(".safetensors"):
            (target / name).write_bytes(open(os.path.join(source, name), "rb").read())


def test_tied_head_stored_under_both_names_loads_once_from_the_embedding(tmp_path):
    # transformers ties lm_head to embed_tokens after loading: the embedding wins over a stray lm_head tensor
    from safetensors.torch import load_file, save_file
    from tests.models.families import family_checkpoint
    source = family_checkpoint("llama_tied")
    both = tmp_path / "both"
    copy_checkpoint_config(source, both)
    tensors = load_file(os.path.join(source, "model.safetensors"))
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = torch.randn_like(tensors["model.embed_tokens.weight"])
    save_file(tensors, str(both / "model.safetensors"))
    prompts = random_prompts(3, [5, 30], 300)
    with LLM(str(both), kvcache_block_size=16) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outputs] == hf_greedy(source, prompts, 8)


def test_sharded_llama_with_biases_matches_transformers_at_tp_2(tmp_path):
    from transformers import AutoModelForCausalLM
    from tests.models.families import family_checkpoint
    source = family_checkpoint("llama")
    sharded = str(tmp_path / "sharded")
    AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).save_pretrained(sharded, max_shard_size="50KB")
    with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
        assert len(set(json.load(f)["weight_map"].values())) > 2
    prompts = random_prompts(8, [6, 70], 300)
    with LLM(sharded, kvcache_block_size=16, tensor_parallel_size=2) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outputs] == hf_greedy(source, prompts, 8)
