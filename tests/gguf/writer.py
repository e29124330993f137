"""A Hugging Face checkpoint folder written as a GGUF file with gguf's own writer, as llama.cpp's
convert_hf_to_gguf.py writes one: its metadata keys, its tensor names, its q/k permutation for LLaMA, the byte-level
BPE tokenizer as `tokenizer.ggml.*`, each 2-D weight in the block type asked for."""
import json
import math
import os
import re

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType, TokenType, quants
from safetensors.numpy import load_file

from tpengine.gguf.config import ARCHITECTURES
from tpengine.gguf.tensors import _LAYER, _TOP, layer_names


def gguf_name(hf_name: str, layers: dict[str, str] = _LAYER) -> str:
    """layers: the family's (tensors.layer_names), GGUF stem -> Hugging Face name."""
    module, _, suffix = hf_name.rpartition(".")
    if module.startswith("model.layers."):
        layer, _, rest = module.removeprefix("model.layers.").partition(".")
        return f"blk.{layer}.{next(g for g, h in layers.items() if h == rest)}.{suffix}"
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
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(config.get("rope_theta") or rope.get("full_attention", rope)["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    # Phi-4-mini rotates only part of each head: llama.cpp's Phi3MiniModel writes the rotated dimensions
    partial = config.get("partial_rotary_factor") or (config.get("rope_parameters") or {}).get("partial_rotary_factor")
    writer.add_rope_dimension_count(int(head_dim * (partial or 1.0)))
    if config["model_type"] == "gemma2":  # as llama.cpp's Gemma2Model writes them
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    if config["model_type"] in ("gemma2", "gemma3_text", "gpt_oss"):
        writer.add_sliding_window(config["sliding_window"])
    if config["model_type"] == "phi3":  # as llama.cpp's Phi3MiniModel writes them (0: no window)
        writer.add_sliding_window(config.get("sliding_window") or 0)
        if _longrope(config) is not None:
            writer.add_rope_scaling_orig_ctx_len(config["original_max_position_embeddings"])
    scaling = rope.get("full_attention", rope)
    if scaling.get("rope_type") == "linear":  # as llama.cpp's converters write it
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])
    if scaling.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(scaling["factor"])
        writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
    experts = config.get("num_experts") or config.get("num_local_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        # gpt-oss's experts are intermediate_size wide
        writer.add_expert_feed_forward_length(config.get("moe_intermediate_size") or config["intermediate_size"])


def _longrope(config: dict) -> dict | None:
    """A Phi-3 config's LongRoPE parameters (transformers 5 writes rope_parameters, 4 rope_scaling), or None."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    return rope if rope.get("rope_type", rope.get("type")) in ("longrope", "su") else None


def llama3_rope_freqs(config: dict):
    """rope_freqs.weight as llama.cpp's LlamaModel.generate_extra_tensors writes it for a llama3 rope (float32,
    in torch, as there; its pre-training window from the config's top level, as there), or None. Written apart from
    gguf/config.py's float64 twin on purpose: the file's side of the check."""
    import torch
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if rope.get("rope_type") != "llama3":
        return None
    base = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context_len = config.get("original_max_position_embeddings", 8192)
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_context_len / high:
            factors.append(1)
        elif wavelen > old_context_len / low:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


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


_STACKED_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up|down)_proj(_bias)?$")


def _gpt_oss_experts(layer: str, projection: str, bias: str | None, weights: np.ndarray) -> dict[str, np.ndarray]:
    """gpt-oss's stacked experts as llama.cpp's GptOssModel writes them: gate and up (interleaved columns of
    gate_up_proj [experts, in, out]) apart, every weight [experts, out, in]."""
    suffix = "bias" if bias else "weight"
    if projection == "down":
        return {f"blk.{layer}.ffn_down_exps.{suffix}": weights if bias else weights.transpose(0, 2, 1)}
    gate, up = weights[..., 0::2], weights[..., 1::2]
    if not bias:
        gate, up = gate.transpose(0, 2, 1), up.transpose(0, 2, 1)
    return {f"blk.{layer}.ffn_gate_exps.{suffix}": np.ascontiguousarray(gate),
            f"blk.{layer}.ffn_up_exps.{suffix}": np.ascontiguousarray(up)}


def _gguf_tensors(tensors: dict[str, np.ndarray], layers: dict[str, str]) -> dict[str, np.ndarray]:
    """The checkpoint's tensors under their GGUF names; each layer's experts stacked, per projection."""
    named, experts = {}, {}
    for hf_name, weights in tensors.items():
        stacked = _STACKED_EXPERTS.match(hf_name)
        if stacked:
            named.update(_gpt_oss_experts(*stacked.groups(), weights))
            continue
        if hf_name.endswith(".self_attn.sinks"):
            hf_name += ".weight"  # llama.cpp names the sinks attn_sinks.weight
        expert = _EXPERT.match(hf_name)
        if expert is None:
            named[gguf_name(hf_name, layers)] = weights
        else:
            layer, index, projection = expert.groups()
            experts.setdefault(f"blk.{layer}.ffn_{projection}_exps.weight", {})[int(index)] = weights
    for name, by_index in experts.items():
        named[name] = np.stack([by_index[i] for i in range(len(by_index))])
    return named


def quantize_q6_k(weights: np.ndarray) -> np.ndarray:
    """Q6_K blocks of weights [rows, n * 256] (gguf quantizes no K-quant), built from the block layout llama.cpp
    documents: per 16 values an int8 scale, per 256 a float16 one, 6-bit values stored as 4 low and 2 high bits.
    Round to nearest on a max-abs scale: any valid block serves, gguf.quants.dequantize reads it back."""
    rows = weights.shape[0]
    groups = weights.reshape(rows, -1, 16, 16)  # [rows, blocks, 16 groups, 16 values]
    amax = np.abs(groups).max(axis=-1)
    d = (amax.max(axis=-1) / (31 * 127)).astype(np.float16)  # the super-block's scale
    safe_d = np.where(d == 0, 1, d).astype(np.float32)[..., None]
    sc = np.clip(np.round(amax / (31 * safe_d)), 0, 127).astype(np.int8)
    step = (safe_d * sc)[..., None]
    q = np.where(step == 0, 0, np.clip(np.round(groups / np.where(step == 0, 1, step)), -32, 31))
    u = (q.reshape(rows, -1, 256) + 32).astype(np.uint8)
    low, high = [], []
    for h in range(2):
        part = u[..., 128 * h:128 * h + 128]
        quarters = [part[..., 32 * i:32 * i + 32] for i in range(4)]
        low += [(quarters[0] & 0x0F) | (quarters[2] & 0x0F) << 4, (quarters[1] & 0x0F) | (quarters[3] & 0x0F) << 4]
        high.append(sum((quarters[i] >> 4) << (2 * i) for i in range(4)).astype(np.uint8))
    blocks = np.concatenate([*low, *high, sc.view(np.uint8), d[..., None].view(np.uint8).reshape(rows, -1, 2)],
                            axis=-1)
    return blocks.reshape(rows, -1)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)[..., None].view(np.uint8)


def _pack_bits(values: np.ndarray, bits: int) -> np.ndarray:
    """Runs of n values, 8 // bits of them, into n bytes, the first run in the lowest bits (a K-quant's bit planes;
    with bits 4, a run of nibbles)."""
    runs = values.reshape(*values.shape[:-1], 8 // bits, -1).astype(np.uint8)
    return sum(runs[..., i, :] << (bits * i) for i in range(8 // bits)).astype(np.uint8)


def _scales_minimums(groups: np.ndarray, levels: int, scale_max: int):
    """Round to nearest on each group's [min(w, 0), max(w)] (groups [rows, blocks, n, size]): (float16 d, dmin
    [rows, blocks], integer scales and minimums [rows, blocks, n] up to scale_max, values 0..levels)."""
    low, high = np.minimum(groups.min(-1), 0), groups.max(-1)
    d = ((high - low).max(-1) / (levels * scale_max)).astype(np.float16)
    dmin = ((-low).max(-1) / scale_max).astype(np.float16)
    safe = lambda t: np.where(t == 0, 1, t).astype(np.float32)[..., None]  # noqa: E731
    sc = np.clip(np.round((high - low) / levels / safe(d)), 0, scale_max)
    m = np.clip(np.round(-low / safe(dmin)), 0, scale_max)
    step, offset = (safe(d) * sc)[..., None], (dmin.astype(np.float32)[..., None] * m)[..., None]
    q = np.where(step == 0, 0, np.clip(np.round((groups + offset) / np.where(step == 0, 1, step)), 0, levels))
    return d, dmin, sc.astype(np.uint8), m.astype(np.uint8), q.astype(np.uint8)


def _k4_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 12 bytes of eight 6-bit scales and minimums (llama.cpp's get_scale_min_k4 read backwards)."""
    return np.concatenate([sc[..., :4] | (sc[..., 4:] >> 4) << 6, m[..., :4] | (m[..., 4:] >> 4) << 6,
                           (sc[..., 4:] & 0x0F) | (m[..., 4:] & 0x0F) << 4], axis=-1)


def quantize_k(weights: np.ndarray, kind: str) -> np.ndarray:
    """Q2_K, Q3_K, Q4_K or Q5_K blocks of weights [rows, n * 256] (gguf quantizes no K-quant), built from the block
    layouts llama.cpp documents, rounding to nearest: any valid block serves, gguf.quants.dequantize reads it back."""
    rows = weights.shape[0]
    if kind == "Q3_K":
        return _quantize_q3_k(weights.reshape(rows, -1, 16, 16))
    group = 16 if kind == "Q2_K" else 32
    levels = {"Q2_K": 3, "Q4_K": 15, "Q5_K": 31}[kind]
    d, dmin, sc, m, q = _scales_minimums(weights.reshape(rows, -1, 256 // group, group), levels,
                                         15 if kind == "Q2_K" else 63)
    q = q.reshape(rows, -1, 256)
    if kind == "Q2_K":
        parts = [sc | m << 4, _pack_bits(q.reshape(rows, -1, 2, 128), 2).reshape(rows, -1, 64), _f16_bytes(d),
                 _f16_bytes(dmin)]
    else:  # Q4_K, Q5_K: per 64 values 32 bytes of nibbles; Q5_K's fifth bits first, a plane per group of 32
        nibbles = _pack_bits(q.reshape(rows, -1, 4, 64) & 0x0F, 4).reshape(rows, -1, 128)
        high = [_pack_bits(q >> 4, 1)] if kind == "Q5_K" else []
        parts = [_f16_bytes(d), _f16_bytes(dmin), _k4_scales(sc, m), *high, nibbles]
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def _quantize_q3_k(groups: np.ndarray) -> np.ndarray:
    """groups [rows, blocks, 16, 16]: signed 3-bit values on a max-abs scale per 16 (6-bit, less 32), a float16 d."""
    rows = groups.shape[0]
    amax = np.abs(groups).max(-1)
    d = (amax.max(-1) / (4 * 31)).astype(np.float16)
    sc = np.clip(np.round(amax / (4 * np.where(d == 0, 1, d).astype(np.float32)[..., None])), 0, 31)
    step = (d.astype(np.float32)[..., None] * sc)[..., None]
    q = np.where(step == 0, 0, np.clip(np.round(groups / np.where(step == 0, 1, step)), -4, 3)) + 4
    q = q.reshape(rows, -1, 256).astype(np.uint8)  # a value plus 4: low bits, and the high bit set when >= 0
    scales = (sc + 32).astype(np.uint8)
    parts = [_pack_bits(q >> 2, 1), _pack_bits(q.reshape(rows, -1, 2, 128) & 3, 2).reshape(rows, -1, 64),
             _pack_bits(scales & 0x0F, 4), _pack_bits(scales >> 4, 2), _f16_bytes(d)]
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def _quantized(weights: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
    if kind == GGMLQuantizationType.Q6_K:
        return quantize_q6_k(weights)
    if kind.name in ("Q2_K", "Q3_K", "Q4_K", "Q5_K"):
        return quantize_k(weights, kind.name)
    try:
        return quants.quantize(weights, kind)
    except (quants.QuantError, NotImplementedError):  # a type nobody quantizes here: zero blocks of the right size
        return np.zeros(quants.quant_shape_to_byte_shape(weights.shape, kind), dtype=np.uint8)


def write_gguf(folder: str, path: str, weight_type: str = "F32", arch: str | None = None,
               types: dict[str, str] | None = None, tokenizer: bool = True) -> str:
    """The checkpoint at folder as the GGUF file path: every 2-D weight in weight_type (F32, F16, BF16, Q8_0,
    Q4_0, Q4_K, ...) unless types names its own by GGUF name; norms and biases F32, as llama.cpp keeps them."""
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    arch = arch or {"qwen3_moe": "qwen3moe", "gemma3_text": "gemma3", "gpt_oss": "gpt-oss"}.get(config["model_type"], config["model_type"])
    writer = GGUFWriter(path, arch)
    _add_metadata(writer, config)
    if tokenizer:
        _add_tokenizer(writer, folder, config)
    rope_freqs = llama3_rope_freqs(config) if arch == "llama" else None
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs, raw_dtype=GGMLQuantizationType.F32)
    for kind in ("long", "short"):  # LongRoPE's factors, as llama.cpp's Phi3MiniModel writes them
        factors = (_longrope(config) or {}).get(f"{kind}_factor")
        if arch == "phi3" and factors is not None:
            writer.add_tensor(f"rope_factors_{kind}.weight", np.asarray(factors, dtype=np.float32),
                              raw_dtype=GGMLQuantizationType.F32)
    described = ARCHITECTURES.get(arch, ARCHITECTURES["llama"])
    for name, weights in _gguf_tensors(load_file(os.path.join(folder, "model.safetensors")),
                                       layer_names(described)).items():
        if described.norm_plus_one and name.endswith("norm.weight"):  # llama.cpp's Gemma converters add 1
            weights = weights + 1
        if arch == "llama" and ".attn_q." in name:
            weights = permute(weights, config["num_attention_heads"])
        elif arch == "llama" and ".attn_k." in name:
            weights = permute(weights, config["num_key_value_heads"])
        # norms, biases and the MoE router stay F32, as llama.cpp's quantizer leaves them
        float32 = weights.ndim == 1 or name.endswith(".bias") or ".ffn_gate_inp." in name or ".attn_sinks." in name
        kind = GGMLQuantizationType[(types or {}).get(name, "F32" if float32 else weight_type)]
        writer.add_tensor(name, _quantized(weights.astype(np.float32), kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
