"""Tiny PEFT LoRA adapters made by peft itself, on tiny random base models, deterministically from a seed.

peft initialises LoRA B to zero (an adapter that changes nothing); make_peft_adapter draws A and B at random so
an adapter's effect shows in the logits and tokens."""
import copy
import os

import torch

from tpengine.tiny_model import write_tiny_model

# hidden 64, 2 layers, 4 heads over 2 KV heads of 16; the byte tokenizer needs a vocabulary past its 257 tokens
TINY_BASE = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, initializer_range=0.1,
                 tie_word_embeddings=False)
# Phi-3's defaults put pad (32000) past the tiny vocabulary
ARCHITECTURE_SETTINGS = {"Phi3ForCausalLM": dict(pad_token_id=0)}
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
PHI3_FUSED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
LORA_STD = 0.1  # with hidden 64 and r 8 the LoRA term moves logits about as much as the base layer's own


def write_tiny_base(path: str, architecture: str = "Qwen3ForCausalLM", seed: int = 0, **overrides) -> str:
    """A tiny random checkpoint (with the byte tokenizer) for adapters to sit on; returns path."""
    settings = {**TINY_BASE, **ARCHITECTURE_SETTINGS.get(architecture, {}), **overrides}
    return write_tiny_model(path, seed=seed, architecture=architecture, **settings)


def make_peft_adapter(base, out_dir: str, r: int = 8, alpha: float = 16, targets=ATTENTION + MLP, seed: int = 0,
                      use_rslora: bool = False, init_random: bool = True, rank_pattern: dict | None = None,
                      alpha_pattern: dict | None = None, safe_serialization: bool = True, **lora_settings) -> str:
    """Wrap base (a checkpoint folder, or a transformers model, left untouched) with peft's LoraConfig, draw every
    LoRA A and B from N(0, LORA_STD) (init_random=False keeps peft's own init, B zero), and save_pretrained it
    to out_dir (.safetensors, or adapter_model.bin with safe_serialization=False); returns out_dir.

    targets: a tuple of module names, or a string peft takes as is (a regex, "all-linear");
    lora_settings: any other LoraConfig field (use_dora, lora_bias, modules_to_save, ...)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets if isinstance(targets, str) else list(targets),
                        use_rslora=use_rslora, rank_pattern=rank_pattern or {}, alpha_pattern=alpha_pattern or {},
                        task_type="CAUSAL_LM", **lora_settings)
    torch.manual_seed(seed)  # peft's own initialisation of A draws from the global generator
    model = get_peft_model(_base_model(base), config)
    if init_random:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".lora_A." in name or ".lora_B." in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * LORA_STD)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=safe_serialization)
    return out_dir


def load_peft_model(base: str, adapter_dir: str):
    """transformers' model with peft's adapter applied, float32, in eval mode: the reference to compare with."""
    from peft import PeftModel

    return PeftModel.from_pretrained(_base_model(base), adapter_dir).eval()


def _base_model(base):
    if isinstance(base, str):
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return copy.deepcopy(base)  # peft injects its layers in place
