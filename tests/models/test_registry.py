"""The registry picks the model by architectures[0]; settings we do not implement are a ValueError naming them."""

import pytest
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

from tests.conftest import as_hf_config, hf_greedy, random_prompts
from tests.models.families import SMALL
from tpengine import LLM, SamplingParams
from tpengine.hf_config import ARCHITECTURES, max_model_len_of, sliding_window_of
from tpengine.models.registry import model_class
from tpengine.tiny_model import write_tiny_model

CONFIGS = {"Qwen3ForCausalLM": Qwen3Config, "Qwen2ForCausalLM": Qwen2Config, "LlamaForCausalLM": LlamaConfig,
           "MistralForCausalLM": MistralConfig, "Qwen3MoeForCausalLM": Qwen3MoeConfig}


def write_config(path, config_class, architecture, **settings) -> str:
    config_class(architectures=[architecture], **{**SMALL, "head_dim": 16, **settings}).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("architecture", list(CONFIGS))
def test_each_architecture_maps_to_its_model_class(architecture):
    config = as_hf_config(CONFIGS[architecture](architectures=[architecture]))
    assert model_class(config).__name__ == architecture


def test_unknown_architecture_is_a_value_error_listing_the_supported_ones(tmp_path):
    path = write_config(tmp_path, LlamaConfig, "GPT2LMHeadModel")
    with pytest.raises(ValueError, match="architecture 'GPT2LMHeadModel' is not supported; supported: "
                                         + ", ".join(ARCHITECTURES)):
        LLM(path)


@pytest.mark.parametrize("architecture", list(CONFIGS))
def test_an_activation_other_than_silu_is_a_value_error_for_every_family(architecture, tmp_path):
    path = write_config(tmp_path, CONFIGS[architecture], architecture, hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act='gelu' is not supported"):
        LLM(path)


@pytest.mark.parametrize("window", [None, 48, 4096])
def test_a_window_never_bounds_max_model_len(window):
    config = as_hf_config(MistralConfig(sliding_window=window, max_position_embeddings=32768))
    assert max_model_len_of(config, 4096) == 4096
    assert max_model_len_of(config, 65536) == 32768  # the positions do


def test_qwen_windows_apply_only_to_sliding_layers():
    assert sliding_window_of(as_hf_config(Qwen3Config(use_sliding_window=False, sliding_window=64))) is None
    # layers from max_window_layers on slide; with none past it, every layer attends fully
    assert sliding_window_of(as_hf_config(Qwen2Config(use_sliding_window=True, sliding_window=64,
                                                      num_hidden_layers=4, max_window_layers=4))) is None
    assert sliding_window_of(as_hf_config(Qwen2Config(use_sliding_window=True, sliding_window=64,
                                                      num_hidden_layers=4, max_window_layers=2))) == 64


def test_qwen3_sliding_layers_after_max_window_layers_stay_exact_past_the_window(tmp_path):
    path = write_tiny_model(str(tmp_path / "qwen3_window"), seed=3, with_tokenizer=False,
                            **{**SMALL, "head_dim": 16, "use_sliding_window": True, "sliding_window": 32,
                               "max_window_layers": 1})
    prompts = random_prompts(4, [5, 31, 32, 90], 300)
    with LLM(path, kvcache_block_size=16, max_num_batched_tokens=40) as llm:
        assert llm.max_model_len == 1024
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outputs] == hf_greedy(path, prompts, 40)


def test_a_quantization_method_tpengine_does_not_read_is_a_value_error(tmp_path):
    path = write_config(tmp_path, Qwen2Config, "Qwen2ForCausalLM",
                        quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True})
    with pytest.raises(ValueError, match="bitsandbytes"):
        LLM(path)
