"""GPTQ checkpoints (AutoGPTQ's and GPTQModel's "gptq" and "gptq_v2"): 4 and 8 bits, any group size, desc_act (g_idx),
sym or not; int32 words pack the input features of each output column."""
import math

import torch

from tpengine.quantization.config import Layout, LinearScheme, QuantizationConfig, register_format, register_layout
from tpengine.quantization.readers import SCALE_DTYPES, Tensors, read_group_index, unpack_int32
from tpengine.quantization.weights import QuantizedWeight

_GPTQ_SUFFIXES = frozenset({"qweight", "qzeros", "scales", "g_idx"})


@register_format("gptq")
def _gptq_config(d: dict) -> QuantizationConfig:
    bits, group_size = d.get("bits"), d.get("group_size", -1)
    if bits not in (4, 8):
        raise ValueError(f"GPTQ bits {bits} is not supported; tpengine reads 4 and 8 bits")
    if not isinstance(group_size, int) or (group_size <= 0 and group_size != -1):
        raise ValueError(f"GPTQ group_size {group_size!r} is not supported; use a positive size or -1")
    checkpoint_format = d.get("checkpoint_format") or d.get("format") or "gptq"
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format {checkpoint_format!r} is not supported; tpengine reads gptq "
                         "and gptq_v2")
    if d.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
        raise ValueError(f"GPTQ pack_dtype {d['pack_dtype']!r} is not supported; tpengine reads int32")
    skipped = []
    for pattern, override in (d.get("dynamic") or {}).items():
        if not pattern.startswith("-:"):
            raise ValueError(f"GPTQ dynamic override {pattern!r} is not supported; tpengine reads '-:' exclusions")
        skipped.append("re:" + pattern[2:])
    # a list of lists of names within a decoder layer, in the order GPTQ quantizes them ("self_attn.q_proj", ...)
    quantized_only = tuple(name for names in d.get("modules_in_block_to_quantize") or ()
                           for name in ([names] if isinstance(names, str) else names))
    scheme = LinearScheme(layout="gptq", bits=bits, group_size=None if group_size == -1 else group_size,
                          symmetric=bool(d.get("sym", True)), activation="float",
                          strategy="channel" if group_size == -1 else "group",
                          zeros_stored_minus_one=checkpoint_format == "gptq")
    return QuantizationConfig(method="gptq", schemes=((("Linear",), scheme),), ignore=tuple(skipped),
                              not_converted=tuple(d.get("modules_to_not_convert") or ()),
                              quantized_only=quantized_only, lm_head_quantized=bool(d.get("lm_head", False)))


def _read_gptq(tensors: Tensors, scheme: LinearScheme) -> QuantizedWeight:
    per_word = 32 // scheme.bits
    qweight = tensors.get("qweight", (torch.int32,))
    scales = tensors.get("scales", SCALE_DTYPES)
    if qweight.dim() != 2 or scales.dim() != 2:
        raise tensors.error("qweight", f"shape {list(qweight.shape)} with scales {list(scales.shape)}, "
                            "expected [in * bits / 32, out] and [groups, out]")
    in_features, out_features = qweight.size(0) * per_word, qweight.size(1)
    group_size = scheme.group_size or in_features
    num_groups = math.ceil(in_features / group_size)
    scales = tensors.scale("scales", (num_groups, out_features))
    if out_features % per_word:
        raise tensors.error("qzeros", f"{out_features} output features do not pack into int32 by {per_word}")
    qzeros = tensors.get("qzeros", (torch.int32,), (num_groups, out_features // per_word))
    # GPTQ packs the input features of each output column: [in / per_word, out]
    values = unpack_int32(qweight, scheme.bits, 0).t()
    zeros = unpack_int32(qzeros, scheme.bits, 1).t().float()
    if scheme.zeros_stored_minus_one:
        zeros = zeros + 1
    midpoint = 1 << (scheme.bits - 1)
    zeros = zeros - midpoint
    if scheme.symmetric:
        if bool((zeros != 0).any()):
            raise tensors.error("qzeros", f"sym is true but the zero points are not all {midpoint}")
        zeros = None
    return QuantizedWeight(bits=scheme.bits, qweight=(values - midpoint).to(torch.int8).contiguous(),
                           scales=scales.t().contiguous(), zeros=zeros if zeros is None else zeros.contiguous(),
                           group_size=group_size,
                           group_index=read_group_index(tensors, "g_idx", in_features, num_groups, group_size))


register_layout("gptq", Layout(_GPTQ_SUFFIXES, "qweight", _read_gptq))
