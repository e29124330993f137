"""Llama 2 and 3.x: the reference pre-norm decoder (RMSNorm, grouped-query attention, rotary, SiLU-gated
MLP). Bias on q/k/v/o when attention_bias, on the MLP when mlp_bias (both off in Meta's checkpoints);
llama3 rope scaling from 3.1 on; Llama 3.2 1B/3B tie the head to the embedding."""
from tpengine.hf_config import HFConfig
from tpengine.models.decoder import DecoderFamily, DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    @staticmethod
    def family(config: HFConfig) -> DecoderFamily:
        return DecoderFamily(qkv_bias=config.attention_bias, o_bias=config.attention_bias, mlp_bias=config.mlp_bias)
