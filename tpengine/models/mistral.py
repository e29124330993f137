"""Mistral: the Llama decoder without any bias, plus a sliding attention window (sliding_window; null from
v0.2 on). A window shorter than max_model_len caps max_model_len (tpengine.hf_config.max_model_len_of),
so attention never reaches past it and tokens stay exact."""
from tpengine.hf_config import HFConfig
from tpengine.models.decoder import DecoderFamily, DecoderForCausalLM


class MistralForCausalLM(DecoderForCausalLM):
    @staticmethod
    def family(config: HFConfig) -> DecoderFamily:
        return DecoderFamily()
