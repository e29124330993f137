"""The random-weight Qwen3 models the benchmarks run, written locally with transformers (nothing is downloaded).

Each shape is Qwen3ForCausalLM's config; write_model writes one into a folder once and reuses it after.
"""
import os
import sys
import time

ROPE = dict(rope_theta=1_000_000.0, rms_norm_eps=1e-6, initializer_range=0.02)
# ~34M parameters: big enough that the matmuls run near the cores' peak, small enough for minutes on 2 cores
CPU_MODEL = dict(vocab_size=16384, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
                 tie_word_embeddings=True, **ROPE)
# nano-vllm's bench model: Qwen3-0.6B's shape
QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                  tie_word_embeddings=True, **ROPE)
# the llama.cpp comparison's shape (docs/benchmarks.md): ~18M parameters, an untied LM head
LOW_BATCH_MODEL = dict(vocab_size=8192, hidden_size=512, intermediate_size=1024, num_hidden_layers=6,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
                       tie_word_embeddings=False, **ROPE)
# what a --quick run writes: writes and loads in a second. CPU_MODEL's vocabulary, as the workloads draw token
# ids below 10,000.
QUICK_MODEL = dict(vocab_size=16384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                   tie_word_embeddings=True, **ROPE)

# where benchmarks keep the models they reuse between runs, by name
CACHE = os.path.expanduser("~/.cache/tpengine-bench")
CACHED_MODEL_FOLDERS = {"qwen3-0.6b": "qwen3_0_6b_model", "small": "low_batch_model"}


def write_model(device: str, folder: str, shape: dict | None = None) -> str:
    """A random-weight Qwen3 of `shape` (default: QWEN3_0_6B on cuda, CPU_MODEL on the CPU) in folder: written
    there unless an earlier run did."""
    from tpengine.tiny_model import write_tiny_model
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    started = time.perf_counter()
    shape = shape or (QWEN3_0_6B if device == "cuda" else CPU_MODEL)
    write_tiny_model(folder, seed=0, with_tokenizer=False, **shape)
    print(f"wrote a random-weight Qwen3 to {folder} in {time.perf_counter() - started:.1f}s", file=sys.stderr)
    return folder


def num_params(config) -> int:
    """A Qwen3-shaped config's parameters (norms left out)."""
    layer = (config.hidden_size * (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
             + config.num_attention_heads * config.head_dim * config.hidden_size
             + 3 * config.hidden_size * config.intermediate_size)
    embeddings = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    return config.num_hidden_layers * layer + embeddings


def model_fields(config) -> dict:
    """The model's shape, for a JSON record."""
    return dict(hidden_size=config.hidden_size, num_hidden_layers=config.num_hidden_layers,
                num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
                head_dim=config.head_dim, intermediate_size=config.intermediate_size, vocab_size=config.vocab_size,
                tie_word_embeddings=config.tie_word_embeddings, params=num_params(config))
