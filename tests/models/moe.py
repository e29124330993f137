"""A tiny random Qwen3-MoE checkpoint written by transformers: 8 experts, top-2, normalised, one dense layer."""
import functools

from tests.leftovers import session_folder
from tpengine.tiny_model import write_tiny_model

MOE_MODEL = dict(architecture="Qwen3MoeForCausalLM", with_tokenizer=False, vocab_size=1003, hidden_size=64,
                 intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                 mlp_only_layers=[1], decoder_sparse_step=1, max_position_embeddings=1024,
                 tie_word_embeddings=False, initializer_range=0.1)


@functools.lru_cache(maxsize=None)
def moe_checkpoint() -> str:
    return write_tiny_model(session_folder(prefix="tpengine-moe-"), seed=11, **MOE_MODEL)
