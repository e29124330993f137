"""Qwen2 and Qwen2.5: the Llama-style decoder with bias on the q, k and v projections (always, whatever
the config says) and none on o or the MLP; YaRN rope for long context; tied head in the small sizes."""
from tpengine.hf_config import HFConfig
from tpengine.models.decoder import DecoderFamily, DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    @staticmethod
    def family(config: HFConfig) -> DecoderFamily:
        return DecoderFamily(qkv_bias=True)
