"""Qwen3: the Llama-style decoder with an RMSNorm over each head's queries and keys before the rotary
embedding (QK-norm); bias on q/k/v/o only when attention_bias says so; head_dim given in the config
(it need not be hidden / heads); tied head in the small sizes."""
from tpengine.hf_config import HFConfig
from tpengine.models.decoder import DecoderFamily, DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    @staticmethod
    def family(config: HFConfig) -> DecoderFamily:
        bias = config.attention_bias
        return DecoderFamily(qkv_bias=bias, o_bias=bias, qk_norm=True)
