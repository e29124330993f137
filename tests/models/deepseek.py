"""Tiny random DeepSeek checkpoints written by transformers: a V2-Lite shape (queries projected directly, softmax
routing, YaRN with DeepSeek's mscale) and a V3 shape (q_lora_rank, sigmoid routing in groups with a correction bias,
first dense layers, a multi-token-prediction layer's tensors beside the model's), and the V3 one as DeepSeek
publishes it, in block FP8."""
import functools
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

from tests.leftovers import session_folder
from tests.quantization.test_fp8 import block_fp8
from tpengine.tiny_model import write_tiny_model

VOCAB = 1003
MLA = dict(with_tokenizer=False, vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
           num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
           head_dim=8, v_head_dim=24,  # head_dim: the rotary part, as the config class sets it (the tiny default's 32)
           max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.1)
# V2-Lite: no q_lora_rank, 8 routed experts (top 2 of softmax), 2 shared, a dense first layer, YaRN past a 32-token
# window with mscale and mscale_all_dim (the softmax scale grows by mscale_all_dim's factor squared)
DEEPSEEK_V2_LITE = dict(MLA, architecture="DeepseekV2ForCausalLM", num_hidden_layers=3, q_lora_rank=None,
                        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1,
                        topk_method="greedy", routed_scaling_factor=1.5,
                        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=0.707,
                                             mscale_all_dim=0.707, beta_fast=32.0, beta_slow=1.0,
                                             original_max_position_embeddings=32))
# V2 proper: group-limited greedy routing (2 of 4 groups) and a q_lora_rank
DEEPSEEK_V2_GROUPS = dict(DEEPSEEK_V2_LITE, q_lora_rank=48, topk_method="group_limited_greedy", n_group=4,
                          topk_group=2, num_experts_per_tok=3, rope_parameters=None)
# V3: 16 experts in 4 groups (top 2 groups, then top 3 experts), sigmoid scores normalised and scaled, one shared
# expert, two dense layers, interleaved rotary pairs
DEEPSEEK_V3 = dict(MLA, architecture="DeepseekV3ForCausalLM", num_hidden_layers=4, q_lora_rank=48,
                   n_routed_experts=16, num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1,
                   first_k_dense_replace=2, norm_topk_prob=True, routed_scaling_factor=2.5, rope_interleave=True,
                   num_nextn_predict_layers=1)
CHECKPOINTS = {"v2_lite": DEEPSEEK_V2_LITE, "v2_groups": DEEPSEEK_V2_GROUPS, "v3": DEEPSEEK_V3}
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}


@functools.lru_cache(maxsize=None)
def deepseek_checkpoint(name: str) -> str:
    settings = CHECKPOINTS[name]
    path = write_tiny_model(session_folder(prefix=f"tpengine-deepseek-{name}-"), seed=len(name) + 3, **settings)
    if settings.get("num_nextn_predict_layers"):
        _add_mtp_layer(path, settings["num_hidden_layers"])
    return path


def _add_mtp_layer(path: str, index: int) -> None:
    """DeepSeek V3's published files hold its multi-token-prediction layer as model.layers.<num_hidden_layers>;
    transformers skips it on load."""
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    last = f"model.layers.{index - 1}."
    tensors.update({name.replace(last, f"model.layers.{index}."): tensor.clone()
                    for name, tensor in tensors.items() if name.startswith(last)})
    hidden = tensors["model.norm.weight"].size(0)
    g = torch.Generator().manual_seed(index)
    prefix = f"model.layers.{index}."
    tensors.update({prefix + "enorm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
                    prefix + "hnorm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
                    prefix + "shared_head.norm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
                    prefix + "eh_proj.weight": 0.1 * torch.randn(hidden, 2 * hidden, generator=g),
                    # V3's files repeat the embedding and the head in the layer
                    prefix + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
                    prefix + "shared_head.head.weight": tensors["lm_head.weight"].clone()})
    save_file(tensors, file, metadata={"format": "pt"})


def _fp8_quantized(name: str, tensor: torch.Tensor) -> bool:
    """The tensors DeepSeek's FP8 release quantizes: every linear of the layers (experts too) but the routers."""
    return tensor.dim() == 2 and name.startswith("model.layers.") and not name.endswith(".mlp.gate.weight")


@functools.lru_cache(maxsize=None)
def fp8_checkpoints() -> tuple[str, str]:
    """(the V3 checkpoint in block FP8 with weight_scale_inv, the float checkpoint of its dequantized values: the
    oracle transformers runs)."""
    source = deepseek_checkpoint("v3")
    fp8, reference = session_folder(prefix="tpengine-deepseek-fp8-"), session_folder(prefix="tpengine-deepseek-ref-")
    for folder in (fp8, reference):
        for name in os.listdir(source):
            if not name.endswith(".safetensors"):
                shutil.copy(os.path.join(source, name), folder)
    quantized, dequantized = {}, {}
    for name, tensor in load_file(os.path.join(source, "model.safetensors")).items():
        if not _fp8_quantized(name, tensor):
            quantized[name] = dequantized[name] = tensor
            continue
        blocks = block_fp8(tensor, (16, 16))
        quantized[name], quantized[name + "_scale_inv"] = blocks["weight"], blocks["weight_scale_inv"]
        scale = blocks["weight_scale_inv"].repeat_interleave(16, 0)[:tensor.size(0)].repeat_interleave(16, 1)
        dequantized[name] = blocks["weight"].float() * scale[:, :tensor.size(1)]
    save_file(quantized, os.path.join(fp8, "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, os.path.join(reference, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(fp8, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(fp8, "config.json"), "w") as f:
        json.dump({**config, "quantization_config": FP8_CONFIG}, f)
    return fp8, reference
