"""A Hugging Face checkpoint folder written as a GGUF file with gguf's own writer, as llama.cpp's
convert_hf_to_gguf.py writes one: its metadata keys, its tensor names, its q/k permutation for LLaMA, the byte-level
BPE tokenizer as `tokenizer.ggml.*`, each 2-D weight in the block type asked for."""
import json
import os
import re

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, TokenType, quants
from safetensors.numpy import load_file

from tpengine.gguf.tensors import _LAYER, _TOP

_TO_GGUF = {hf: gguf for gguf, hf in _LAYER.items()}


def gguf_name(hf_name: str) -> str:
    module, _, suffix = hf_name.rpartition(".")
    if module.startswith("model.layers."):
        layer, _, rest = module.removeprefix("model.layers.").partition(".")
        return f"blk.{layer}.{_TO_GGUF[rest]}.{suffix}"
    return f"{next(g for g, h in _TOP.items() if h == module)}.{suffix}"


def permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: each head's rotary halves interleaved."""
    return weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:]) \
        .swapaxes(1, 2).reshape(weights.shape)


def _add_metadata(writer: GGUFWriter, config: dict) -> None:
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config.get("rope_theta") or config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    experts = config.get("num_experts") or config.get("num_local_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])


def _add_tokenizer(writer: GGUFWriter, folder: str, config: dict) -> None:
    with open(os.path.join(folder, "tokenizer.json")) as f:
        tokenizer = json.load(f)
    vocab = dict(tokenizer["model"]["vocab"])
    special = {token["content"]: token["id"] for token in tokenizer["added_tokens"]}
    vocab.update(special)
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    tokens += [f"[PAD{i}]" for i in range(config["vocab_size"] - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL if t in special else TokenType.NORMAL for t in tokens])
    writer.add_token_scores([0.0] * len(tokens))  # read where there are no merges (the byte tokenizer has none)
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    from transformers import AutoTokenizer
    writer.add_chat_template(AutoTokenizer.from_pretrained(folder).chat_template)


_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def _gguf_tensors(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The checkpoint's tensors under their GGUF names; each layer's experts stacked, per projection."""
    named, experts = {}, {}
    for hf_name, weights in tensors.items():
        expert = _EXPERT.match(hf_name)
        if expert is None:
            named[gguf_name(hf_name)] = weights
        else:
            layer, index, projection = expert.groups()
            experts.setdefault(f"blk.{layer}.ffn_{projection}_exps.weight", {})[int(index)] = weights
    for name, by_index in experts.items():
        named[name] = np.stack([by_index[i] for i in range(len(by_index))])
    return named


def _quantized(weights: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
    try:
        return quants.quantize(weights, kind)
    except (quants.QuantError, NotImplementedError):  # gguf quantizes no K-quant: zero blocks of the right size
        return np.zeros(quants.quant_shape_to_byte_shape(weights.shape, kind), dtype=np.uint8)


def write_gguf(folder: str, path: str, weight_type: str = "F32", arch: str | None = None,
               types: dict[str, str] | None = None, tokenizer: bool = True) -> str:
    """The checkpoint at folder as the GGUF file path: every 2-D weight in weight_type (F32, F16, BF16, Q8_0,
    Q4_0, Q4_K, ...) unless types names its own by GGUF name; norms and biases F32, as llama.cpp keeps them."""
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    arch = arch or {"qwen3_moe": "qwen3moe"}.get(config["model_type"], config["model_type"])
    writer = GGUFWriter(path, arch)
    _add_metadata(writer, config)
    if tokenizer:
        _add_tokenizer(writer, folder, config)
    for name, weights in _gguf_tensors(load_file(os.path.join(folder, "model.safetensors"))).items():
        if arch == "llama" and ".attn_q." in name:
            weights = permute(weights, config["num_attention_heads"])
        elif arch == "llama" and ".attn_k." in name:
            weights = permute(weights, config["num_key_value_heads"])
        # norms, biases and the MoE router stay F32, as llama.cpp's quantizer leaves them
        float32 = weights.ndim == 1 or ".ffn_gate_inp." in name
        kind = GGMLQuantizationType[(types or {}).get(name, "F32" if float32 else weight_type)]
        writer.add_tensor(name, _quantized(weights.astype(np.float32), kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
