"""A GGUF checkpoint's tensors under the Hugging Face checkpoint's names, each in the form it runs from.

F32, F16 and BF16 are float tensors. Every block type maps exactly onto a QuantizedWeight, a block (or a K-quant
super-block's sub-block) one group of input features with its float32 scale, gguf.quants.dequantize's values bit for
bit: Q8_0 as int8 and Q4_0 as int4 values less 8 (its w = d * (q - 8) is our symmetric int4 form), a scale per 32;
Q5_0 (5-bit values less 16) and IQ4_NL and IQ4_XS (4-bit codes for 16 int8 levels) as int8, a scale per 32; Q6_K (6-bit
values less 32) as int8 and Q3_K (signed 3-bit values) as int4, a scale per 16 (the super-block's times the group's).
The types with a minimum, w = d * q - m, keep it as QuantizedWeight.minimums, a float per group: Q4_1 (as int4 values
less 8 over zero points -8) and Q5_1 (as int8) per 32; Q4_K (as Q4_1) and Q5_K (as int8) per 32, scale and minimum the
super-block's d and dmin times the group's 6-bit ones; Q2_K (2-bit values as int4) per 16, times 4-bit ones.
Every other type is a ValueError naming it and the tensor: it runs from no kernel of ours yet, and is never quietly
dequantized to float.

llama.cpp's converter interleaves the two rotary halves of each q and k head for its LLaMA rope
(convert_hf_to_gguf.py, LlamaModel.permute); unpermute_rows undoes it, on the rows of any type, whose blocks lie
along the input features.
"""
import re
from dataclasses import replace
from collections.abc import Callable, Iterator

import numpy as np
import torch

from tpengine.gguf.config import ROPE_TENSORS, RUNNABLE_TYPES, check_type, gguf_architecture
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
GROUP = 32  # input features per block of the 32-value types (Q8_0, Q4_0, ...) and group of most


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


def _blocks(data: np.ndarray, block_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """(float32 scales [out, blocks], each block's value bytes [out, blocks, block_bytes - 2]) of a block type
    whose blocks start with a float16 scale."""
    blocks = data.reshape(data.shape[0], -1, block_bytes)
    return _f16(blocks, 0), blocks[..., 2:]


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """float32 [out, blocks]: the float16 each block holds at byte start."""
    return np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """A run of bytes' values, low nibbles first (byte j: value j low, value j + len high), as in every 4-bit type."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _bit_fields(packed: np.ndarray, bits: int) -> np.ndarray:
    """[..., 8 // bits * n]: a run of n bytes' values of `bits` bits, the lowest bits of every byte first (2-bit and
    1-bit planes of the K-quants)."""
    shifts = np.arange(0, 8, bits, dtype=np.uint8)[:, None]
    return ((packed[..., None, :] >> shifts) & ((1 << bits) - 1)).reshape(*packed.shape[:-1], -1)


def _weight(values: np.ndarray, scales, group_size: int = GROUP, bits: int = 8, minimums=None,
            shift: int = 0) -> QuantizedWeight:
    """A QuantizedWeight of values [out, ...] (bits: the width they fit signed, after less shift) and float32 scales
    and minimums [out, ...]; shift stored as zeros -shift, so (q - shift) - (-shift) gives back q exactly."""
    out = values.shape[0]
    as_tensor = lambda t: None if t is None else \
        torch.from_numpy(np.ascontiguousarray(t).reshape(out, -1))  # noqa: E731
    scales = as_tensor(scales)
    qweight = torch.from_numpy((values.astype(np.int16) - shift).astype(np.int8).reshape(out, -1))
    return QuantizedWeight(bits=bits, qweight=qweight, scales=scales,
                           zeros=torch.full_like(scales, -float(shift)) if shift else None, group_size=group_size,
                           minimums=as_tensor(minimums))


def _q8_0(data: np.ndarray) -> QuantizedWeight:
    scales, values = _blocks(data, 2 + GROUP)
    return _weight(np.ascontiguousarray(values).view(np.int8), scales)


def _q4_0(data: np.ndarray) -> QuantizedWeight:
    scales, packed = _blocks(data, 2 + GROUP // 2)
    return _weight(_nibbles(packed).astype(np.int8) - 8, scales, bits=4)


def _q4_1(data: np.ndarray) -> QuantizedWeight:
    """A block: float16 scale d, float16 minimum m, 16 bytes of nibbles; w = d * q + m. 4-bit values less 8 over zero
    points -8, minimums -m."""
    scales, rest = _blocks(data, 2 + 2 + GROUP // 2)
    return _weight(_nibbles(rest[..., 2:]), scales, bits=4, minimums=-_f16(rest, 0), shift=8)


def _five_bits(rest: np.ndarray) -> np.ndarray:
    """Values 0..31 of a Q5 block's 32 high bits (little-endian) and 16 bytes of low nibbles: value j (< 16) is byte
    j's low nibble with high bit j, value j + 16 its high nibble with high bit j + 16."""
    high_bits = np.ascontiguousarray(rest[..., :4]).view("<u4")  # [out, blocks, 1]
    bits = ((high_bits >> np.arange(GROUP, dtype=np.uint32)) & 1).astype(np.uint8) << 4
    return _nibbles(rest[..., 4:]) | bits


def _q5_0(data: np.ndarray) -> QuantizedWeight:
    """A block: float16 scale, then _five_bits' 20 bytes; values less 16."""
    scales, rest = _blocks(data, 2 + 4 + GROUP // 2)
    return _weight(_five_bits(rest).astype(np.int8) - 16, scales)


def _q5_1(data: np.ndarray) -> QuantizedWeight:
    """A block: float16 scale d, float16 minimum m, then _five_bits' 20 bytes; w = d * q + m. Values 0..31 as int8,
    minimums -m."""
    scales, rest = _blocks(data, 2 + 2 + 4 + GROUP // 2)
    return _weight(_five_bits(rest[..., 2:]), scales, minimums=-_f16(rest, 0))


def _k_blocks(data: np.ndarray, kind: str) -> np.ndarray:
    return data.reshape(data.shape[0], -1, K_BLOCK_BYTES[kind])


def _k_scales_minimums(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 ([out, blocks, 8] scales, minimums) of a Q4_K/Q5_K super-block: float16 d and dmin, then 12 bytes of
    eight 6-bit scales and eight 6-bit minimums (llama.cpp's get_scale_min_k4: bytes 0-3 hold scales 0-3 and the top
    bits of 4-7, bytes 4-7 minimums 0-3 and the top bits of 4-7, bytes 8-11 the low nibbles of 4-7); each the
    product with d or dmin, rounded once in float32 as llama.cpp rounds it."""
    d, m, low = blocks[..., 4:8], blocks[..., 8:12], blocks[..., 12:16]
    scales = np.concatenate([d & 0x3F, (low & 0x0F) | ((d >> 2) & 0x30)], axis=-1).astype(np.float32)
    minimums = np.concatenate([m & 0x3F, (low >> 4) | ((m >> 2) & 0x30)], axis=-1).astype(np.float32)
    return _f16(blocks, 0)[..., None] * scales, _f16(blocks, 2)[..., None] * minimums


def _q4_k(data: np.ndarray) -> QuantizedWeight:
    """A super-block of 256: d, dmin, 6-bit scales and minimums (_k_scales_minimums), 128 bytes of nibbles, each 32
    bytes two groups of 32 (low nibbles, then high); w = d * sc * q - dmin * m per 32. 4-bit values less 8 over zero
    points -8, a scale and a minimum per 32."""
    blocks = _k_blocks(data, "Q4_K")
    scales, minimums = _k_scales_minimums(blocks)
    values = _nibbles(blocks[..., 16:].reshape(*blocks.shape[:2], 4, 32))
    return _weight(values, scales, bits=4, minimums=minimums, shift=8)


def _q5_k(data: np.ndarray) -> QuantizedWeight:
    """Q4_K's super-block with 32 bytes of high bits before the nibbles: group g's value l takes bit g of byte l.
    Values 0..31 as int8, a scale and a minimum per 32."""
    blocks = _k_blocks(data, "Q5_K")
    scales, minimums = _k_scales_minimums(blocks)
    low = _nibbles(blocks[..., 48:].reshape(*blocks.shape[:2], 4, 32)).reshape(*blocks.shape[:2], 8, 32)
    high = _bit_fields(blocks[..., 16:48], 1).reshape(low.shape)
    return _weight(low | high << 4, scales, minimums=minimums)


def _q2_k(data: np.ndarray) -> QuantizedWeight:
    """A super-block of 256: 16 bytes of 4-bit scales (low) and minimums (high), one each per 16 values, 64 bytes
    of 2-bit values (each half of 128 takes 32 bytes, lowest bits first), float16 d and dmin; w = d * sc * q -
    dmin * m. Values 0..3 as int4, a scale and a minimum per 16."""
    blocks = _k_blocks(data, "Q2_K")
    scales = _f16(blocks, 80)[..., None] * (blocks[..., :16] & 0x0F).astype(np.float32)
    minimums = _f16(blocks, 82)[..., None] * (blocks[..., :16] >> 4).astype(np.float32)
    values = _bit_fields(blocks[..., 16:80].reshape(*blocks.shape[:2], 2, 32), 2)
    return _weight(values, scales, group_size=16, bits=4, minimums=minimums)


def _q3_k(data: np.ndarray) -> QuantizedWeight:
    """A super-block of 256: 32 bytes of high bits (value 32 i + l: bit i of byte l), 64 bytes of 2-bit low values
    (as Q2_K's), 12 bytes of sixteen 6-bit scales (low nibbles in bytes 0-7, low then high; top bit pairs in bytes
    8-11, lowest first), less 32, a float16 d. A value is its low bits less 4 where its high bit is unset. Values
    -4..3 as int4, a scale per 16 (d times the group's, exact)."""
    blocks = _k_blocks(data, "Q3_K")
    low_scales = _nibbles(blocks[..., 96:104])
    high_scales = _bit_fields(blocks[..., 104:108], 2)
    group_scales = ((low_scales | high_scales << 4).astype(np.int8) - 32).astype(np.float32)
    low = _bit_fields(blocks[..., 32:96].reshape(*blocks.shape[:2], 2, 32), 2).reshape(*blocks.shape[:2], 256)
    high = _bit_fields(blocks[..., :32], 1)
    values = low.astype(np.int8) - ((high ^ 1) << 2).astype(np.int8)
    return _weight(values, _f16(blocks, 108)[..., None] * group_scales, group_size=16, bits=4)


def _q6_k(data: np.ndarray) -> QuantizedWeight:
    """A super-block of 256: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales (one per 16 values), a
    float16 scale. Each half of 128 values takes 64 low-nibble bytes and 32 high-bit bytes: its quarters q read
    low (q even) or high (q odd) nibbles of bytes q // 2 * 32 + l, and bit pair q of high byte l; values less 32.
    Exact as 6-bit values with a scale per 16 (the super-block's times the group's)."""
    blocks = _k_blocks(data, "Q6_K")
    low, high = blocks[..., :128], blocks[..., 128:192]
    group_scales = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)
    halves = []
    for h in range(2):
        lows, highs = low[..., 64 * h:64 * h + 64], high[..., 32 * h:32 * h + 32]
        for quarter in range(4):
            nibbles = lows[..., quarter % 2 * 32:quarter % 2 * 32 + 32]
            nibbles = nibbles >> 4 if quarter >= 2 else nibbles & 0x0F
            halves.append(nibbles | ((highs >> (2 * quarter)) & 3) << 4)
    values = np.concatenate(halves, axis=-1).astype(np.int8) - 32
    return _weight(values, _f16(blocks, 208)[..., None] * group_scales, group_size=16)  # both exact in float32


# IQ4's 16 levels (llama.cpp's kvalues_iq4nl): a 4-bit code stands for one of these int8 values
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def _iq4_nl(data: np.ndarray) -> QuantizedWeight:
    """Q4_0's layout (a float16 scale, 16 bytes of codes, low nibbles first) with each code read through IQ4_LEVELS:
    int8 values, a scale per 32."""
    scales, packed = _blocks(data, 2 + GROUP // 2)
    return _weight(IQ4_LEVELS[_nibbles(packed)], scales)


# MXFP4's e2m1 codes as llama.cpp reads them (kvalues_mxfp4): each value doubled, so every one is an int8
MXFP4_LEVELS = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)


def _mxfp4(data: np.ndarray) -> QuantizedWeight:
    """A block of 32: an e8m0 exponent byte, then 16 bytes of e2m1 codes laid out as Q4_0's. int8 values (the
    doubled e2m1 values), a scale per 32: the exponent's power of two halved (ggml_e8m0_to_fp32_half), exact."""
    blocks = data.reshape(data.shape[0], -1, 1 + GROUP // 2)
    exponents = blocks[..., 0].astype(np.uint32)
    bits = np.where(exponents < 2, np.uint32(0x00200000) << exponents, (exponents - 1) << np.uint32(23))
    return _weight(MXFP4_LEVELS[_nibbles(blocks[..., 1:])], bits.astype(np.uint32).view(np.float32))


def _iq4_xs(data: np.ndarray) -> QuantizedWeight:
    """A super-block of 256: a float16 scale, 16 high and 4 bytes of low scale bits (a 6-bit scale, less 32, per
    32 values), 128 bytes of IQ4 codes laid out as IQ4_NL's per 32. int8 values, a scale per 32 (the product of
    the two, exact in float32)."""
    blocks = _k_blocks(data, "IQ4_XS")
    high = np.ascontiguousarray(blocks[..., 2:4]).view("<u2").astype(np.int32)  # [out, blocks, 1]
    low = blocks[..., 4:8].astype(np.int32)
    sub = np.arange(8)
    group_scales = ((low[..., sub // 2] >> (4 * (sub % 2))) & 0x0F) | (((high >> (2 * sub)) & 3) << 4)
    scales = _f16(blocks, 0)[..., None] * (group_scales - 32).astype(np.float32)
    codes = blocks[..., 8:].reshape(*blocks.shape[:2], 8, 16)
    return _weight(IQ4_LEVELS[_nibbles(codes)], scales)


def _float(data: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(data))


def _bf16(data: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(data).view(np.int16)).view(torch.bfloat16)


_READERS = {"F32": _float, "F16": _float, "BF16": _bf16, "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1,
            "Q5_0": _q5_0, "Q5_1": _q5_1, "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
            "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs, "MXFP4": _mxfp4}
# bytes of one super-block of 256 values
K_BLOCK_BYTES = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "IQ4_XS": 136}
assert tuple(_READERS) == RUNNABLE_TYPES


def _reader(tensor, rows: Callable[[], np.ndarray], minus_one: bool = False, activation: str = "float") -> Callable:
    if minus_one:  # a Gemma norm, which the converter wrote as w + 1
        return lambda: _READERS[check_type(tensor)](rows()) - 1

    def read():
        loaded = _READERS[check_type(tensor)](rows())
        return replace(loaded, activation=activation) if isinstance(loaded, QuantizedWeight) else loaded
    return read


def checkpoint_tensors(checkpoint: GGUFCheckpoint, activation: str = "float") -> Iterator[tuple[str, str, Callable]]:
    """(GGUF name, Hugging Face name, a function reading it) for every tensor of the checkpoint (each expert of a
    stacked expert tensor on its own; rope_freqs, which the config holds, left out), the q/k rows of a permuted
    family put back in transformers' order, a Gemma norm back to w. Reading is deferred: a rank reads only what it
    loads. activation: how the linear of each block-quantized tensor takes its input ("float", or "int8" per token)."""
    arch, described = gguf_architecture(checkpoint.metadata, checkpoint.path)
    heads = {"attn_q": checkpoint.metadata.get(f"{arch}.attention.head_count")}
    heads["attn_k"] = checkpoint.metadata.get(f"{arch}.attention.head_count_kv", heads["attn_q"])
    layers = layer_names(described)
    for gguf_name, tensor in checkpoint.tensors.items():
        if gguf_name in ROPE_TENSORS:  # the config reads them (config.py), no weight holds them
            continue
        match = _BLOCK.match(gguf_name)
        if match is not None and match[2] in _EXPERTS:
            for expert in range(tensor.data.shape[0]):
                yield (gguf_name, f"model.layers.{match[1]}.mlp.experts.{expert}.{_EXPERTS[match[2]]}.{match[3]}",
                       _reader(tensor, lambda tensor=tensor, expert=expert: tensor.data[expert],
                               activation=activation))
            continue
        num_heads = heads.get(match[2]) if match is not None and described.permuted_qk else None
        rows = (lambda tensor=tensor: tensor.data) if num_heads is None else \
            (lambda tensor=tensor, num_heads=num_heads: unpermute_rows(tensor.data, num_heads))
        minus_one = described.norm_plus_one and gguf_name.endswith("norm.weight")
        yield gguf_name, hf_name(gguf_name, layers), _reader(tensor, rows, minus_one, activation)
