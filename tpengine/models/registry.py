"""Which model class serves a checkpoint: keyed on config.json's architectures[0], as transformers names it.

Model modules are imported only when a model is built, so rank 0 can check a config without torch.
"""
import importlib

from transformers import PretrainedConfig

from tpengine.models.config import check_supported

# architecture -> (module, class)
ARCHITECTURES = {
    "Qwen3ForCausalLM": ("tpengine.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen2ForCausalLM": ("tpengine.models.qwen2", "Qwen2ForCausalLM"),
    "LlamaForCausalLM": ("tpengine.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("tpengine.models.mistral", "MistralForCausalLM"),
    "Qwen3MoeForCausalLM": ("tpengine.models.qwen3_moe", "Qwen3MoeForCausalLM"),
}


def architecture_of(config: PretrainedConfig) -> str:
    """The checkpoint's architecture; ValueError listing the supported ones when we have no model for it."""
    architectures = getattr(config, "architectures", None) or []
    supported = ", ".join(ARCHITECTURES)
    if not architectures:
        raise ValueError(f"config.json names no architectures; supported: {supported}")
    if architectures[0] not in ARCHITECTURES:
        raise ValueError(f"architecture {architectures[0]!r} is not supported; supported: {supported}")
    return architectures[0]


def check_model_config(config: PretrainedConfig) -> None:
    """ValueError for a checkpoint we cannot run exactly: unknown architecture or an unimplemented setting."""
    architecture_of(config)
    check_supported(config)


def model_class(config: PretrainedConfig):
    module, name = ARCHITECTURES[architecture_of(config)]
    return getattr(importlib.import_module(module), name)
