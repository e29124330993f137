"""Which model class serves a checkpoint: keyed on config.json's architectures[0], as transformers names it.

The supported architectures are data in tpengine/hf_config.py, so rank 0 checks a config without torch;
model modules are imported only when a model is built.
"""
import importlib

from tpengine.hf_config import ARCHITECTURES, HFConfig, architecture_of

# architecture -> (module, class)
MODEL_CLASSES = {
    "Qwen3ForCausalLM": ("tpengine.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen2ForCausalLM": ("tpengine.models.qwen2", "Qwen2ForCausalLM"),
    "LlamaForCausalLM": ("tpengine.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("tpengine.models.mistral", "MistralForCausalLM"),
    "Qwen3MoeForCausalLM": ("tpengine.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "Gemma2ForCausalLM": ("tpengine.models.gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("tpengine.models.gemma", "Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("tpengine.models.gemma", "Gemma3ForConditionalGeneration"),
    "Phi3ForCausalLM": ("tpengine.models.phi3", "Phi3ForCausalLM"),
    "GptOssForCausalLM": ("tpengine.models.gpt_oss", "GptOssForCausalLM"),
}
assert set(MODEL_CLASSES) == set(ARCHITECTURES), "every supported architecture needs its class, and only those"


def model_class(config: HFConfig):
    module, name = MODEL_CLASSES[architecture_of(config.architectures)]
    return getattr(importlib.import_module(module), name)
