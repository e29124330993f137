"""Mistral: the Llama decoder without any bias, plus a sliding attention window in every layer (sliding_window;
null from v0.2 on): each token attends to itself and the window - 1 tokens before it, at any length."""
from tpengine.hf_config import HFConfig
from tpengine.models.decoder import DecoderFamily, DecoderForCausalLM


class MistralForCausalLM(DecoderForCausalLM):
    @staticmethod
    def family(config: HFConfig) -> DecoderFamily:
        return DecoderFamily()
