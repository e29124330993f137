"""Inverse frequencies and YaRN's attention scaling equal transformers' rope initialisation, type by type."""
import math

import pytest
import torch
from transformers import GptOssConfig, LlamaConfig, Qwen2Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from tests.conftest import as_hf_config
from tpengine.hf_config import head_dim_of, parse_hf_config, rope_parameters_of
from tpengine.layers.rotary_embedding import RotaryEmbedding, inverse_frequencies

SCALED = [
    {"rope_type": "linear", "factor": 2.5},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16, "beta_slow": 2,
     "truncate": False},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
     "mscale_all_dim": 0.707},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048, "attention_factor": 0.9},
]


def config_with(rope: dict, head_dim: int | None = 128, config_class=LlamaConfig):
    params = {"rope_theta": 500000.0, **rope}
    return config_class(hidden_size=512, num_attention_heads=4, head_dim=head_dim, max_position_embeddings=4096,
                        rope_parameters=params)


@pytest.mark.parametrize("rope", SCALED, ids=lambda r: f"{r['rope_type']}-{r['factor']}")
@pytest.mark.parametrize("head_dim", [128, 48])
def test_scaled_inverse_frequencies_equal_transformers(rope, head_dim):
    config = config_with(rope, head_dim)
    expected, expected_scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")
    ours = as_hf_config(config)
    inv_freq, scaling = inverse_frequencies(head_dim_of(ours), rope_parameters_of(ours))
    assert torch.equal(inv_freq, expected)
    assert scaling == expected_scaling


@pytest.mark.parametrize("config_class", [LlamaConfig, Qwen2Config])
def test_default_inverse_frequencies_equal_transformers(config_class):
    config = config_with({"rope_type": "default"}, head_dim=None, config_class=config_class)
    expected, scaling = LlamaRotaryEmbedding.compute_default_rope_parameters(config=config, device="cpu")
    ours = as_hf_config(config)
    inv_freq, our_scaling = inverse_frequencies(head_dim_of(ours), rope_parameters_of(ours))
    assert torch.equal(inv_freq, expected) and our_scaling == scaling == 1.0


def test_cos_sin_cache_equals_transformers_rotary_embedding_with_yarn_scaling():
    config = config_with({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024})
    positions = torch.arange(4096)
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions[None])
    ours = RotaryEmbedding(128, 4096, rope_parameters_of(as_hf_config(config))).cos_sin_cache
    half = ours.size(1) // 2
    assert torch.equal(ours[:, :half], cos[0, :, :half]) and torch.equal(ours[:, half:], sin[0, :, :half])


def test_gpt_oss_default_yarn_without_truncation_equals_transformers_rotary_embedding():
    config = GptOssConfig(num_hidden_layers=2)  # no rope_parameters: yarn, factor 32 over 4096, truncate false
    positions = torch.arange(8192)
    cos, sin = GptOssRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions[None])  # half width
    rope = rope_parameters_of(as_hf_config(config))
    assert (rope.rope_type, rope.truncate, rope.theta) == ("yarn", False, 150000.0)
    ours = RotaryEmbedding(config.head_dim, 8192, rope).cos_sin_cache
    half = ours.size(1) // 2
    assert torch.equal(ours[:, :half], cos[0]) and torch.equal(ours[:, half:], sin[0])


def test_transformers_4_rope_scaling_keys_are_read():
    config = parse_hf_config({"model_type": "llama", "max_position_embeddings": 4096, "rope_theta": 10000.0,
                              "rope_scaling": {"type": "linear", "factor": 4.0}}, "config.json")
    rope = rope_parameters_of(config)
    assert (rope.rope_type, rope.factor, rope.theta) == ("linear", 4.0, 10000.0)


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope", "mrope"])
def test_other_rope_types_are_a_value_error_naming_the_type(rope_type):
    config = parse_hf_config({"model_type": "llama", "rope_parameters": {"rope_type": rope_type, "rope_theta": 1e4,
                                                                           "factor": 2.0}}, "config.json")
    with pytest.raises(ValueError, match=f"rope type '{rope_type}' is not supported"):
        rope_parameters_of(config)


def phi3_config(partial_rotary_factor: float = 1.0, **rope):
    from transformers import Phi3Config
    num_frequencies = int(32 * partial_rotary_factor) // 2
    params = {"rope_type": "longrope", "rope_theta": 10000.0,
              "short_factor": [1.0 + 0.1 * i for i in range(num_frequencies)],
              "long_factor": [1.5 + 2.0 * i for i in range(num_frequencies)], **rope}
    return Phi3Config(hidden_size=128, num_attention_heads=4, max_position_embeddings=1024,
                      original_max_position_embeddings=64, partial_rotary_factor=partial_rotary_factor,
                      rope_parameters=params)


# no factor: max_position_embeddings / original_max_position_embeddings = 16; a given one; a given attention factor
@pytest.mark.parametrize("rope, scaling", [({}, (1 + math.log(16) / math.log(64)) ** 0.5),
                                           ({"factor": 4.0}, (1 + math.log(4) / math.log(64)) ** 0.5),
                                           ({"attention_factor": 1.5}, 1.5)], ids=str)
def test_longrope_short_and_long_frequencies_and_attention_factor_equal_transformers(rope, scaling):
    config = phi3_config(**rope)
    short, short_scaling = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu")
    long, long_scaling = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=65)
    rope = rope_parameters_of(as_hf_config(config))
    assert torch.equal(inverse_frequencies(32, rope)[0], short)
    assert not torch.equal(short, long) and short_scaling == long_scaling == pytest.approx(scaling)
    # both sets in one cache: the short one's rows at each position, the long one's at position + 1024
    expected = []
    for inv_freq in (short, long):
        freqs = torch.arange(1024)[:, None].float() * inv_freq
        expected.append(torch.cat([freqs.cos() * short_scaling, freqs.sin() * short_scaling], dim=-1))
    assert torch.equal(RotaryEmbedding(32, 1024, rope).cos_sin_cache, torch.cat(expected))


@pytest.mark.parametrize("partial_rotary_factor", [0.75, 0.5])
def test_partial_rotary_turns_the_first_rotary_dim_and_passes_the_rest_as_phi3_does(partial_rotary_factor):
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb
    config = phi3_config(partial_rotary_factor)
    rotary = RotaryEmbedding(32, 1024, rope_parameters_of(as_hf_config(config)))
    assert rotary.rotary_dim == int(32 * partial_rotary_factor)
    positions = torch.tensor([0, 5, 63, 64, 700])
    q, k = torch.randn(5, 4, 32), torch.randn(5, 2, 32)
    # transformers over these positions at once: past the 64-token window, the long set: ours at position + 1024
    ours_q, ours_k = rotary(positions + 1024, q.clone(), k.clone())
    cos, sin = Phi3RotaryEmbedding(config)(q, positions[None])
    expected_q, expected_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    assert torch.allclose(ours_q, expected_q[0].transpose(0, 1), atol=1e-6)
    assert torch.allclose(ours_k, expected_k[0].transpose(0, 1), atol=1e-6)
    assert torch.equal(ours_q[..., rotary.rotary_dim:], q[..., rotary.rotary_dim:])
    fallback_q, fallback_k = rotary(positions + 1024, q.double(), k.double())  # no C++ op takes float64: the torch form
    assert torch.allclose(fallback_q.float(), ours_q, atol=1e-6)
    assert torch.allclose(fallback_k.float(), ours_k, atol=1e-6)


def test_partial_rotary_and_longrope_are_refused_outside_phi3():
    partial = parse_hf_config({"model_type": "llama", "partial_rotary_factor": 0.5}, "config.json")
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5 is not supported for llama"):
        rope_parameters_of(partial)
