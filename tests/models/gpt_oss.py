"""A tiny random gpt-oss checkpoint written by transformers (4 experts, top-2, a 16-token window on layer 0, YaRN,
a swiglu_limit that clamps), and its MXFP4 twin, written by an encoder made from the format's spec."""
import functools
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

from tests.leftovers import session_folder
from tpengine.quantization.mxfp4 import FP4_VALUES, GROUP_SIZE
from tpengine.tiny_model import write_tiny_model

WINDOW = 16
GPT_OSS_MODEL = dict(architecture="GptOssForCausalLM", with_tokenizer=False, vocab_size=1003, hidden_size=64,
                     intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                     max_position_embeddings=256, swiglu_alpha=1.5, swiglu_limit=1.0,
                     rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0,
                                          beta_slow=1.0, truncate=False, original_max_position_embeddings=64),
                     tie_word_embeddings=False, initializer_range=0.1)
# gpt-oss-20b's, with dequantize: transformers then loads it on the CPU without accelerate, dequantized to the
# dtype asked for (float32: the oracle); tpengine dequantizes at load either way
MXFP4_CONFIG = {"quant_method": "mxfp4", "dequantize": True, "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


@functools.lru_cache(maxsize=None)
def gpt_oss_checkpoint() -> str:
    return write_tiny_model(session_folder(prefix="tpengine-gpt-oss-"), seed=5, **GPT_OSS_MODEL)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) of a float [experts, in, out] tensor: per 32 values of a transposed row, the smallest
    power of two that brings them within FP4's +-6, each value rounded to the nearest FP4 value (the spec; the
    tie goes to the lower magnitude)."""
    rows = weight.float().transpose(-2, -1)  # [experts, out, in]
    groups = rows.reshape(*rows.shape[:-1], -1, GROUP_SIZE)
    largest = groups.abs().amax(dim=-1)
    exponents = torch.where(largest > 0, torch.ceil(torch.log2(largest / 6.0)), torch.zeros_like(largest))
    exponents = exponents.clamp(-127, 127)
    scaled = groups / torch.pow(2.0, exponents).unsqueeze(-1)
    magnitudes = torch.tensor(FP4_VALUES[:8])
    codes = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(dim=-1)  # first of equals: the lower one
    codes = codes | ((scaled < 0).long() << 3)
    codes = codes.to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # the even value in the low nibble
    return blocks.contiguous(), (exponents + 127).to(torch.uint8)


@functools.lru_cache(maxsize=None)
def mxfp4_checkpoint() -> str:
    """gpt_oss_checkpoint() with its experts' weights stored as MXFP4 blocks and scales."""
    path = session_folder(prefix="tpengine-gpt-oss-mxfp4-")
    source = gpt_oss_checkpoint()
    for name in os.listdir(source):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(source, name), path)
    tensors = {}
    for file in sorted(f for f in os.listdir(source) if f.endswith(".safetensors")):
        for name, tensor in load_file(os.path.join(source, file)).items():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = quantize_mxfp4(tensor)
            else:
                tensors[name] = tensor
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**config, "quantization_config": MXFP4_CONFIG}, f)
    return path
