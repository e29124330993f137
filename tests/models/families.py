"""Tiny random checkpoints of each supported dense family, written by transformers itself."""
import functools
import os

from tests.leftovers import session_folder
from tpengine.tiny_model import write_tiny_model

BOS = "<|begin_of_text|>"
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=None, max_position_embeddings=1024, initializer_range=0.1,
             tie_word_embeddings=False, vocab_size=1003)
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)  # prompts past 64 tokens reach the scaled frequencies

WINDOW = 48
# Phi-3: fused qkv_proj and gate_up_proj; head_dim hidden / heads (written out: the tiny model's default is 32); pad
# and eos inside the small vocabulary (Phi3Config's 32000 is past it)
PHI3 = dict(architecture="Phi3ForCausalLM", with_tokenizer=False,
            **{**SMALL, "head_dim": 16, "pad_token_id": 1000, "eos_token_id": 999, "bos_token_id": 1})


def longrope(num_frequencies: int) -> dict:
    """LongRoPE over a 64-token pre-training window (1024 positions: attention factor sqrt(1 + ln 16 / ln 64));
    short and long factors far apart, so the set a token is rotated with shows in the tokens."""
    return dict(rope_type="longrope", rope_theta=10000.0,
                short_factor=[1.0 + 0.25 * i for i in range(num_frequencies)],
                long_factor=[2.0 + 3.0 * i for i in range(num_frequencies)])


FAMILIES = {
    # q/k/v/o and MLP biases, llama3 rope with a 64-token original window, head_dim = hidden / heads
    "llama": dict(architecture="LlamaForCausalLM", with_tokenizer=False, attention_bias=True, mlp_bias=True,
                  rope_parameters=LLAMA3_ROPE, **SMALL),
    # Llama 3.2-style: tied head, an odd head count (3 heads, 1 KV head), a tokenizer that adds BOS
    "llama_tied": dict(architecture="LlamaForCausalLM", bos_token=BOS, rope_parameters=LLAMA3_ROPE,
                       **{**SMALL, "hidden_size": 96, "num_attention_heads": 3, "num_key_value_heads": 1,
                          "vocab_size": 300, "tie_word_embeddings": True}),
    # q/k/v bias (none on o), YaRN extending a 64-token window 4x past max_position_embeddings, head_dim given
    "qwen2": dict(architecture="Qwen2ForCausalLM", with_tokenizer=False,
                  rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                       original_max_position_embeddings=64),
                  **{**SMALL, "max_position_embeddings": 64, "head_dim": 32}),
    # no window, linear rope scaling
    "mistral": dict(architecture="MistralForCausalLM", with_tokenizer=False, sliding_window=None,
                    rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0), **SMALL),
    # a 48-token window in every layer: prompts and outputs run past it
    "mistral_window": dict(architecture="MistralForCausalLM", with_tokenizer=False, sliding_window=WINDOW, **SMALL),
    # Qwen2's use_sliding_window: layer 0 attends fully, layer 1 slides (from max_window_layers=1 on)
    "qwen2_window": dict(architecture="Qwen2ForCausalLM", with_tokenizer=False, use_sliding_window=True,
                         sliding_window=WINDOW - 16, max_window_layers=1, **{**SMALL, "head_dim": 16}),
    "phi3": PHI3,
    # Phi-3-mini-4k's sliding window in every layer, here shorter than the longer prompts
    "phi3_window": dict(PHI3, sliding_window=WINDOW - 24),
    # Phi-3-128k / Phi-3.5: LongRoPE past a 64-token original window
    "phi3_longrope": dict(PHI3, rope_parameters=longrope(8), original_max_position_embeddings=64),
    # Phi-4-mini: 3/4 of each head rotated (12 of 16 dimensions), LongRoPE, a tied head
    "phi4_mini": dict(PHI3, partial_rotary_factor=0.75, rope_parameters=longrope(6),
                      original_max_position_embeddings=64, tie_word_embeddings=True),
}


@functools.lru_cache(maxsize=None)
def family_checkpoint(name: str) -> str:
    """The family's checkpoint, written once per test session into a temporary folder."""
    path = os.path.join(_session_dir(), name)
    return write_tiny_model(path, seed=len(name), **FAMILIES[name])


@functools.lru_cache(maxsize=None)
def _session_dir() -> str:
    return session_folder(prefix="tpengine-families-")
