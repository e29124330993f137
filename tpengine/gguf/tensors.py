"""A GGUF checkpoint's tensors under the Hugging Face checkpoint's names, each in the form it runs from.

F32, F16 and BF16 are float tensors. Q8_0 and Q4_0 map exactly onto a QuantizedWeight: each block of 32 input
features is one group with its float16 scale; Q8_0's values are int8, Q4_0's are 4-bit values less 8 (its
w = d * (q - 8) is our symmetric int4 form). Q5_0 (5-bit values less 16, a scale per 32) and Q6_K (6-bit values
less 32, a scale per 16: the super-block's times the group's), IQ4_NL and IQ4_XS (4-bit codes for 16 int8 levels,
a scale per 32) run as int8 values with those scales, as exactly.
Every other type is a ValueError naming it and the tensor: it runs from no kernel of ours yet, and is never quietly
dequantized to float.

llama.cpp's converter interleaves the two rotary halves of each q and k head for its LLaMA rope
(convert_hf_to_gguf.py, LlamaModel.permute); unpermute_rows undoes it, on the rows of any type, whose blocks lie
along the input features.
"""
import re
from collections.abc import Callable, Iterator

import numpy as np
import torch

from tpengine.gguf.config import RUNNABLE_TYPES, check_type, gguf_architecture
from tpengine.gguf.files import GGUFCheckpoint
from tpengine.quantization.weights import QuantizedWeight

_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
          "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
          "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate"}
# a mixture of experts' projections, every expert's stacked in one [experts, out, in] tensor
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
GROUP = 32  # input features per Q8_0 and Q4_0 block
# llama 3's rope scaling as per-frequency factors: config.py reads it as the config's rope_scaling, no weight holds it
ROPE_ONLY = ("rope_freqs.weight",)


def layer_names(described) -> dict[str, str]:
    """GGUF tensor stem -> the Hugging Face name within a layer, for one GGUFArchitecture."""
    return {**_LAYER, **dict(described.layer_names)}


def hf_name(gguf_name: str, layers: dict[str, str] = _LAYER) -> str:
    """The Hugging Face checkpoint's name for a GGUF tensor (blk.3.attn_q.weight -> model.layers.3.self_attn.
    q_proj.weight), layers the family's (layer_names); ValueError naming a tensor no family of ours has."""
    match = _BLOCK.match(gguf_name)
    if match is not None and match[2] in layers:
        return f"model.layers.{match[1]}.{layers[match[2]]}.{match[3]}"
    module, _, suffix = gguf_name.rpartition(".")
    if module in _TOP and suffix in ("weight", "bias"):
        return f"{_TOP[module]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} is not one tpengine reads")


def unpermute_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """The rows of a q or k projection (weight or bias) in Hugging Face's order: llama.cpp stores each head's
    rows as (pair, half); transformers' rotate_half wants (half, pair)."""
    pairs = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, pairs, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _blocks(data: np.ndarray, block_bytes: int) -> tuple[torch.Tensor, np.ndarray]:
    """(float32 scales [out, blocks], each block's value bytes [out, blocks, block_bytes - 2]) of a block type
    whose blocks start with a float16 scale."""
    blocks = data.reshape(data.shape[0], -1, block_bytes)
    scales = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0].astype(np.float32)
    return torch.from_numpy(scales), blocks[..., 2:]


def _q8_0(data: np.ndarray) -> QuantizedWeight:
    scales, values = _blocks(data, 2 + GROUP)
    qweight = torch.from_numpy(np.ascontiguousarray(values).view(np.int8).reshape(data.shape[0], -1))
    return QuantizedWeight(bits=8, qweight=qweight, scales=scales, zeros=None, group_size=GROUP)


def _q4_0(data: np.ndarray) -> QuantizedWeight:
    scales, packed = _blocks(data, 2 + GROUP // 2)
    # byte j of a block holds value j in its low nibble and value j + 16 in its high one
    values = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.int8) - 8
    return QuantizedWeight(bits=4, qweight=torch.from_numpy(values.reshape(data.shape[0], -1)), scales=scales,
                           zeros=None, group_size=GROUP)


def _q5_0(data: np.ndarray) -> QuantizedWeight:
    """A block: float16 scale, 32 high bits (little-endian), 16 bytes of low nibbles; value j (< 16) is byte j's low
    nibble with high bit j, value j + 16 its high nibble with high bit j + 16; values less 16."""
    scales, rest = _blocks(data, 2 + 4 + GROUP // 2)
    high_bits = np.ascontiguousarray(rest[..., :4]).view("<u4")  # [out, blocks, 1]
    bits = ((high_bits >> np.arange(GROUP, dtype=np.uint32)) & 1).astype(np.uint8) << 4
    low = np.concatenate([rest[..., 4:] & 0x0F, rest[..., 4:] >> 4], axis=-1)
    values = (low | bits).astype(np.int8) - 16
    return QuantizedWeight(bits=8, qweight=torch.from_numpy(values.reshape(data.shape[0], -1)), scales=scales,
                           zeros=None, group_size=GROUP)


def _q6_k(data: np.ndarray) -> QuantizedWeight:
    """A super-block of 256: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales (one per 16 values), a
    float16 scale. Each half of 128 values takes 64 low-nibble bytes and 32 high-bit bytes: its quarters q read
    low (q even) or high (q odd) nibbles of bytes q // 2 * 32 + l, and bit pair q of high byte l; values less 32.
    Exact as 6-bit values with a scale per 16 (the super-block's times the group's)."""
    blocks = data.reshape(data.shape[0], -1, K_BLOCK_BYTES["Q6_K"])
    low, high = blocks[..., :128], blocks[..., 128:192]
    group_scales = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)
    block_scales = np.ascontiguousarray(blocks[..., 208:210]).view(np.float16).astype(np.float32)
    halves = []
    for h in range(2):
        lows, highs = low[..., 64 * h:64 * h + 64], high[..., 32 * h:32 * h + 32]
        for quarter in range(4):
            nibbles = lows[..., quarter % 2 * 32:quarter % 2 * 32 + 32]
            nibbles = nibbles >> 4 if quarter >= 2 else nibbles & 0x0F
            halves.append(nibbles | ((highs >> (2 * quarter)) & 3) << 4)
    values = np.concatenate(halves, axis=-1).astype(np.int8) - 32
    scales = (block_scales * group_scales).reshape(data.shape[0], -1)  # both exact in float32
    return QuantizedWeight(bits=8, qweight=torch.from_numpy(values.reshape(data.shape[0], -1)),
                           scales=torch.from_numpy(scales), zeros=None, group_size=16)


# IQ4's 16 levels (llama.cpp's kvalues_iq4nl): a 4-bit code stands for one of these int8 values
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def _iq4_nl(data: np.ndarray) -> QuantizedWeight:
    """Q4_0's layout (a float16 scale, 16 bytes of codes, low nibbles first) with each code read through IQ4_LEVELS:
    int8 values, a scale per 32."""
    scales, packed = _blocks(data, 2 + GROUP // 2)
    values = IQ4_LEVELS[np.concatenate([packed & 0x0F, packed >> 4], axis=-1)]
    return QuantizedWeight(bits=8, qweight=torch.from_numpy(values.reshape(data.shape[0], -1)), scales=scales,
                           zeros=None, group_size=GROUP)


def _iq4_xs(data: np.ndarray) -> QuantizedWeight:
    """A super-block of 256: a float16 scale, 16 high and 4 bytes of low scale bits (a 6-bit scale, less 32, per
    32 values), 128 bytes of IQ4 codes laid out as IQ4_NL's per 32. int8 values, a scale per 32 (the product of
    the two, exact in float32)."""
    blocks = data.reshape(data.shape[0], -1, K_BLOCK_BYTES["IQ4_XS"])
    block_scales = np.ascontiguousarray(blocks[..., :2]).view(np.float16).astype(np.float32)
    high = np.ascontiguousarray(blocks[..., 2:4]).view("<u2").astype(np.int32)  # [out, blocks, 1]
    low = blocks[..., 4:8].astype(np.int32)
    sub = np.arange(8)
    group_scales = ((low[..., sub // 2] >> (4 * (sub % 2))) & 0x0F) | (((high >> (2 * sub)) & 3) << 4)
    scales = block_scales * (group_scales - 32).astype(np.float32)
    codes = blocks[..., 8:].reshape(*blocks.shape[:2], 8, 16)
    values = IQ4_LEVELS[np.concatenate([codes & 0x0F, codes >> 4], axis=-1)]
    return QuantizedWeight(bits=8, qweight=torch.from_numpy(values.reshape(data.shape[0], -1)),
                           scales=torch.from_numpy(scales.reshape(data.shape[0], -1)), zeros=None, group_size=GROUP)


def _float(data: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(data))


def _bf16(data: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(data).view(np.int16)).view(torch.bfloat16)


_READERS = {"F32": _float, "F16": _float, "BF16": _bf16, "Q8_0": _q8_0, "Q4_0": _q4_0, "Q5_0": _q5_0,
            "Q6_K": _q6_k, "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs}
K_BLOCK_BYTES = {"Q6_K": 210, "IQ4_XS": 136}  # bytes of one super-block of 256 values
assert tuple(_READERS) == RUNNABLE_TYPES


def _reader(tensor, rows: Callable[[], np.ndarray], minus_one: bool = False) -> Callable:
    if minus_one:  # a Gemma norm, which the converter wrote as w + 1
        return lambda: _READERS[check_type(tensor)](rows()) - 1
    return lambda: _READERS[check_type(tensor)](rows())


def checkpoint_tensors(checkpoint: GGUFCheckpoint) -> Iterator[tuple[str, str, Callable]]:
    """(GGUF name, Hugging Face name, a function reading it) for every tensor of the checkpoint (each expert of a
    stacked expert tensor on its own; rope_freqs, which the config holds, left out), the q/k rows of a permuted
    family put back in transformers' order, a Gemma norm back to w. Reading is deferred: a rank reads only what it
    loads."""
    arch, described = gguf_architecture(checkpoint.metadata, checkpoint.path)
    heads = {"attn_q": checkpoint.metadata.get(f"{arch}.attention.head_count")}
    heads["attn_k"] = checkpoint.metadata.get(f"{arch}.attention.head_count_kv", heads["attn_q"])
    layers = layer_names(described)
    for gguf_name, tensor in checkpoint.tensors.items():
        if gguf_name in ROPE_ONLY:
            continue
        match = _BLOCK.match(gguf_name)
        if match is not None and match[2] in _EXPERTS:
            for expert in range(tensor.data.shape[0]):
                yield (gguf_name, f"model.layers.{match[1]}.mlp.experts.{expert}.{_EXPERTS[match[2]]}.weight",
                       _reader(tensor, lambda tensor=tensor, expert=expert: tensor.data[expert]))
            continue
        num_heads = heads.get(match[2]) if match is not None and described.permuted_qk else None
        rows = (lambda tensor=tensor: tensor.data) if num_heads is None else \
            (lambda tensor=tensor, num_heads=num_heads: unpermute_rows(tensor.data, num_heads))
        minus_one = described.norm_plus_one and gguf_name.endswith("norm.weight")
        yield gguf_name, hf_name(gguf_name, layers), _reader(tensor, rows, minus_one)
