"""compressed-tensors checkpoints (llm-compressor's): pack-quantized W4A16/W8A16 by group or channel, symmetric or
with zero points, with or without act order's weight_g_idx; int-quantized W8A8 with dynamic per-token int8
activations; float-quantized FP8 by tensor, channel or block; naive-quantized by its weight type. Its config groups
each target linears by name, pattern or class; int- and float-quantized keep the suffix "weight" for the quantized
tensor, so a module is quantized when it carries that format's scale ("weight_scale")."""
import math

import torch

from tpengine.quantization.config import Layout, LinearScheme, QuantizationConfig, register_format, register_layout
from tpengine.quantization.readers import INDEX_DTYPES, Tensors, read_fp8, read_group_index, unpack_int32
from tpengine.quantization.weights import Activation, QuantizedWeight

_PACKED_SUFFIXES = frozenset({"weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "weight_g_idx"})
_UNPACKED_SUFFIXES = frozenset({"weight", "weight_scale", "weight_zero_point", "input_scale"})
# the one kv_cache_scheme read: FP8 with a static per-tensor scale per layer, its k/v_proj.output_scale tensors,
# which kv_cache_dtype="fp8" takes as each layer's k_scale, v_scale (layers/attention.py)
FP8_KV_CACHE_SCHEME = {"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False}
# compressed-tensors' QuantizationArgs defaults, for the keys a config leaves out
_KV_CACHE_SCHEME_DEFAULTS = {"type": "int", "num_bits": 8, "strategy": "tensor", "dynamic": False}


@register_format("compressed-tensors")
def _compressed_tensors_config(d: dict) -> QuantizationConfig:
    if d.get("transform_config"):
        raise ValueError("compressed-tensors transform_config is not supported")
    kv_cache_scheme = d.get("kv_cache_scheme")
    if kv_cache_scheme:
        read = {key: kv_cache_scheme.get(key) or default for key, default in _KV_CACHE_SCHEME_DEFAULTS.items()}
        if read != FP8_KV_CACHE_SCHEME:
            raise ValueError(f"compressed-tensors kv_cache_scheme is not supported unless it is {FP8_KV_CACHE_SCHEME} "
                             f"(FP8 scales per layer, for kv_cache_dtype='fp8'), got {read}")
    sparsity = d.get("sparsity_config") or {}
    if sparsity and sparsity.get("format", "dense") != "dense":
        raise ValueError(f"compressed-tensors sparsity format {sparsity.get('format')!r} is not supported")
    status = d.get("quantization_status", "compressed")
    if status != "compressed":
        raise ValueError(f"compressed-tensors quantization_status {status!r} is not supported: tpengine reads "
                         "checkpoints saved compressed")
    groups = d.get("config_groups") or {}
    if not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    schemes = []
    for name, group in groups.items():
        targets = tuple(group.get("targets") or ())
        for target in targets:
            if not target.startswith("re:") and target != "Linear" and "." not in target and target[:1].isupper():
                raise ValueError(f"compressed-tensors config group {name!r} targets class {target!r}; tpengine "
                                 "reads groups that target 'Linear', module names or 're:' patterns")
        schemes.append((targets, _compressed_tensors_scheme(name, group, group.get("format") or d.get("format"))))
    return QuantizationConfig(method="compressed-tensors", schemes=tuple(schemes),
                              ignore=tuple(d.get("ignore") or ()))


def _compressed_tensors_scheme(name: str, group: dict, layout: str | None) -> LinearScheme:
    weights = group.get("weights")
    if not weights:
        raise ValueError(f"compressed-tensors config group {name!r} quantizes no weights; tpengine reads "
                         "weight-quantized linears")
    if group.get("output_activations"):
        raise ValueError(f"compressed-tensors config group {name!r}: output_activations are not supported")
    weight_type, bits = weights.get("type", "int"), weights.get("num_bits", 8)
    strategy, symmetric = weights.get("strategy") or "tensor", weights.get("symmetric", True)
    if weights.get("dynamic"):
        raise ValueError(f"compressed-tensors config group {name!r}: dynamic weight quantization is not supported")
    if layout == "naive-quantized":
        layout = "float-quantized" if weight_type == "float" else "int-quantized"
    if layout not in ("pack-quantized", "int-quantized", "float-quantized"):
        raise ValueError(f"compressed-tensors format {layout!r} is not supported; tpengine reads pack-quantized, "
                         "int-quantized, float-quantized and naive-quantized")
    if weight_type == "float":
        if layout != "float-quantized" or bits != 8:
            raise ValueError(f"compressed-tensors config group {name!r}: float weights of {bits} bits in "
                             f"{layout!r}; tpengine reads FP8 (8-bit float) weights in float-quantized")
        if strategy not in ("tensor", "channel", "block"):
            raise ValueError(f"compressed-tensors config group {name!r}: FP8 weight strategy {strategy!r} is not "
                             "supported; tpengine reads tensor, channel and block")
        if not symmetric:
            raise ValueError(f"compressed-tensors config group {name!r}: asymmetric FP8 weights are not supported")
        block = weights.get("block_structure")
        if strategy == "block" and (not block or len(block) != 2):
            raise ValueError(f"compressed-tensors config group {name!r}: block strategy needs a block_structure "
                             f"[rows, columns], not {block!r}")
    else:
        if weight_type != "int":
            raise ValueError(f"compressed-tensors config group {name!r}: weight type {weight_type!r} is not supported")
        if layout == "float-quantized":
            raise ValueError(f"compressed-tensors config group {name!r}: int weights in float-quantized format")
        if bits not in (4, 8):
            raise ValueError(f"compressed-tensors config group {name!r}: {bits}-bit weights are not supported; "
                             "tpengine reads 4 and 8 bits")
        if strategy not in ("tensor", "channel", "group"):
            raise ValueError(f"compressed-tensors config group {name!r}: int weight strategy {strategy!r} is not "
                             "supported; tpengine reads tensor, channel and group")
        if layout == "pack-quantized" and not symmetric and strategy == "tensor":
            raise ValueError(f"compressed-tensors config group {name!r}: asymmetric per-tensor packed weights are "
                             "not supported")
    group_size = weights.get("group_size") if strategy == "group" else None
    if strategy == "group" and (not isinstance(group_size, int) or group_size <= 0):
        raise ValueError(f"compressed-tensors config group {name!r}: group strategy with group_size {group_size!r}")
    return LinearScheme(layout=layout, bits=bits, group_size=group_size, symmetric=symmetric,
                        activation=_compressed_tensors_activation(name, group.get("input_activations"), weight_type),
                        weight_type=weight_type, strategy=strategy,
                        block_structure=tuple(weights["block_structure"]) if strategy == "block" else None)


def _compressed_tensors_activation(name: str, inputs: dict | None, weight_type: str) -> Activation:
    if not inputs:
        return "float"
    input_type = inputs.get("type", "int")
    if weight_type == "float" and input_type == "float" and inputs.get("num_bits", 8) == 8:
        # "float" on the CPU, which reads FP8 weights into floats; where FP8 is kept (Fp8Weight), a static scheme is
        # told by its input_scale, and dynamic activations are quantized per token (or per block columns)
        return "float"
    if input_type != "int" or weight_type != "int":
        raise ValueError(f"compressed-tensors config group {name!r}: {input_type} activations with {weight_type} "
                         "weights are not supported")
    if inputs.get("num_bits", 8) != 8 or not inputs.get("symmetric", True):
        raise ValueError(f"compressed-tensors config group {name!r}: activations of {inputs.get('num_bits')} bits, "
                         f"symmetric={inputs.get('symmetric')}; tpengine quantizes activations to symmetric int8")
    if inputs.get("dynamic") is not True:
        raise ValueError(f"compressed-tensors config group {name!r}: static activation scales (input_scale) are "
                         "not supported; tpengine reads int8 activations quantized dynamically per token")
    if inputs.get("strategy") != "token":
        raise ValueError(f"compressed-tensors config group {name!r}: int8 activations by {inputs.get('strategy')!r} "
                         "are not supported; tpengine quantizes activations per token")
    return "int8"


def _read_pack_quantized(tensors: Tensors, scheme: LinearScheme) -> QuantizedWeight:
    shape = tensors.get("weight_shape", INDEX_DTYPES, (2,)).tolist()
    out_features, in_features = shape
    per_word = 32 // scheme.bits
    packed = tensors.get("weight_packed", (torch.int32,), (out_features, math.ceil(in_features / per_word)))
    qweight = (unpack_int32(packed, scheme.bits, 1)[:, :in_features] - (1 << (scheme.bits - 1))).to(torch.int8)
    group_size = scheme.group_size or in_features
    num_groups = math.ceil(in_features / group_size)
    scales = _int_scales(tensors, scheme, out_features, num_groups)
    zeros = None
    if not scheme.symmetric:
        if tensors.has("weight_zero_point") and tensors.tensors["weight_zero_point"].dtype == torch.int32:
            # compressed-tensors packs zero points along the output features
            zero_point = tensors.get("weight_zero_point", (torch.int32,),
                                     (math.ceil(out_features / per_word), num_groups))
            zeros = (unpack_int32(zero_point, scheme.bits, 0)[:out_features] - (1 << (scheme.bits - 1))).float()
        else:  # older compressed-tensors saved them unpacked
            zeros = tensors.get("weight_zero_point", (torch.int8,), (out_features, num_groups)).float()
    group_index = read_group_index(tensors, "weight_g_idx", in_features, num_groups, group_size)
    return QuantizedWeight(bits=scheme.bits, qweight=qweight, scales=scales, zeros=zeros, group_size=group_size,
                           group_index=group_index, activation=scheme.activation)


def _int_scales(tensors: Tensors, scheme: LinearScheme, out_features: int, num_groups: int) -> torch.Tensor:
    """compressed-tensors' weight_scale as float32 [out, num_groups]; a per-tensor scale is repeated."""
    if scheme.strategy == "tensor":
        scale = tensors.scale("weight_scale")
        if scale.numel() != 1:
            raise tensors.error("weight_scale", f"shape {list(scale.shape)}, expected one per-tensor scale")
        return scale.reshape(1, 1).expand(out_features, 1).contiguous()
    return tensors.scale("weight_scale", (out_features, num_groups))


def _read_unpacked(tensors: Tensors, scheme: LinearScheme) -> QuantizedWeight:
    weight = tensors.get("weight", (torch.int8,))
    if weight.dim() != 2:
        raise tensors.error("weight", f"shape {list(weight.shape)}, expected [out, in]")
    out_features, in_features = weight.shape
    low, high = -(1 << (scheme.bits - 1)), (1 << (scheme.bits - 1)) - 1
    if scheme.bits < 8 and (bool((weight < low).any()) or bool((weight > high).any())):
        raise tensors.error("weight", f"values outside the {scheme.bits}-bit range [{low}, {high}]")
    group_size = scheme.group_size or in_features
    num_groups = math.ceil(in_features / group_size)
    scales = _int_scales(tensors, scheme, out_features, num_groups)
    zeros = None
    if not scheme.symmetric:
        zero_point = tensors.get("weight_zero_point", (torch.int8,))
        if scheme.strategy == "tensor":
            zeros = zero_point.float().reshape(1, 1).expand(out_features, 1).contiguous()
        else:
            zeros = tensors.get("weight_zero_point", (torch.int8,), (out_features, num_groups)).float()
    return QuantizedWeight(bits=scheme.bits, qweight=weight.contiguous(), scales=scales, zeros=zeros,
                           group_size=group_size, activation=scheme.activation)


register_layout("pack-quantized", Layout(_PACKED_SUFFIXES, "weight_packed", _read_pack_quantized))
register_layout("int-quantized", Layout(_UNPACKED_SUFFIXES, "weight_scale", _read_unpacked))
register_layout("float-quantized", Layout(_UNPACKED_SUFFIXES, "weight_scale", read_fp8))
