"""Reading a checkpoint's `quantization_config` and its quantized linears into QuantizedWeight.

Formats: compressed-tensors (pack-quantized W4A16/W8A16 by group or channel, symmetric or with zero
points, with or without act order's weight_g_idx; int-quantized W8A8 with dynamic per-token int8
activations; float-quantized FP8 by tensor, channel or block; naive-quantized by its weight type), GPTQ
(AutoGPTQ/GPTQModel "gptq" and "gptq_v2" checkpoints, 4 and 8 bits, any group size, desc_act, sym or not)
and AWQ ("gemm", 4 bits, zero points).

The loader groups a checkpoint's tensors by module prefix and asks, for each module:
    config = QuantizationConfig.from_hf(hf_config["quantization_config"])   # ValueError: what is unsupported
    config.skips(module_name) -> bool          # left float by the checkpoint (ignore, lm_head, ...)
    config.is_quantized(module_name, suffixes_present) -> bool
    config.quantized_tensor(module_name) -> str | None   # what a float weight there lacks (a float checkpoint)
    config.read_linear(module_name, tensors_by_suffix) -> QuantizedWeight | torch.Tensor
`tensor_suffixes` names every suffix a quantized linear of this checkpoint may have (a "bias" stays the
loader's). int-quantized and float-quantized keep the suffix "weight" for the quantized tensor, so a
module is quantized when it is not skipped and carries that format's scale ("weight_scale"), not by its
names alone. read_linear takes one whole, unsharded linear and returns its QuantizedWeight; an FP8 linear
(compressed-tensors float-quantized, or the "fp8" method of DeepSeek-V3's and Qwen's FP8 releases) is read as
its float32 [out, in] weight, its input_scale unused (the CPU converts FP8 at load), or with keep_fp8 as an
Fp8Weight with its scales and input_scale (a platform with FP8 matmuls). Every scale read must be finite:
check_finite_scales (weights.py) names the tensor that is not.
"""
import math
import re
from dataclasses import dataclass

import torch

from tpengine.quantization.fp8 import Fp8Weight
from tpengine.quantization.weights import Activation, QuantizedWeight, check_finite_scales

SUPPORTED_METHODS = "compressed-tensors, fp8, gptq, awq and mxfp4"

_PACKED_SUFFIXES = frozenset({"weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "weight_g_idx"})
_UNPACKED_SUFFIXES = frozenset({"weight", "weight_scale", "weight_zero_point", "input_scale"})
_GPTQ_SUFFIXES = frozenset({"qweight", "qzeros", "scales", "g_idx"})
_AWQ_SUFFIXES = frozenset({"qweight", "qzeros", "scales"})
# the "fp8" method's: a block-scaled weight's scale is weight_scale_inv (it multiplies, despite its name)
_FP8_SUFFIXES = frozenset({"weight", "weight_scale", "weight_scale_inv", "input_scale"})
_FP8_FORMATS = ("e4m3",)
# transformers' FineGrainedFP8Config and vLLM's Fp8Config keys; "dequantize" is transformers' choice at load, not ours
_FP8_KNOWN_KEYS = {"quant_method", "fmt", "activation_scheme", "weight_block_size", "ignored_layers",
                   "modules_to_not_convert", "dequantize"}
# AWQ's gemm packing puts output column order[i] of each run of 8 in nibble i
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True)
class LinearScheme:
    """How one set of linears is stored: `layout` is a compressed-tensors format, "gptq" or "awq"."""
    layout: str  # a compressed-tensors format, "gptq", "awq" or "fp8"
    bits: int
    group_size: int | None  # None: one scale per output channel (or per tensor, or per block for FP8)
    symmetric: bool
    activation: Activation
    weight_type: str = "int"  # "int", or "float" for FP8
    strategy: str = "group"  # compressed-tensors' weight strategy: tensor, channel, group or block
    block_structure: tuple[int, int] | None = None
    zeros_stored_minus_one: bool = False  # GPTQ v1 checkpoints store each zero point less 1


@dataclass(frozen=True)
class QuantizationConfig:
    method: str  # "compressed-tensors", "fp8", "gptq" or "awq"
    schemes: tuple[tuple[tuple[str, ...], LinearScheme], ...]  # (targets, scheme), compressed-tensors' groups
    ignore: tuple[str, ...] = ()  # exact module names and "re:" patterns left float (compressed-tensors)
    not_converted: tuple[str, ...] = ()  # dotted parts of module names left float (GPTQ, AWQ)
    quantized_only: tuple[str, ...] = ()  # dotted parts naming the only modules quantized; (): all (GPTQ)
    lm_head_quantized: bool = False

    # a summary for logs: the first scheme's
    @property
    def bits(self) -> int:
        return self.schemes[0][1].bits

    @property
    def group_size(self) -> int | None:
        return self.schemes[0][1].group_size

    @property
    def activation(self) -> Activation:
        return self.schemes[0][1].activation

    def describe(self) -> str:
        scheme = self.schemes[0][1]
        if scheme.weight_type == "float":  # FP8: its activations are the platform's (float on the CPU)
            blocks = "x".join(map(str, scheme.block_structure)) + " " if scheme.block_structure else ""
            layout = "" if scheme.layout == self.method else f" {scheme.layout}"
            return f"{self.method}{layout} e4m3 weights, scale per {blocks}{scheme.strategy}"
        weight = f"int{scheme.bits}"
        groups = f"group {scheme.group_size}" if scheme.group_size else scheme.strategy
        return f"{self.method} {scheme.layout} {weight} {groups} activation {scheme.activation}"

    @classmethod
    def from_hf(cls, d: dict) -> "QuantizationConfig":
        """From a config.json's `quantization_config` (MXFP4's is an Mxfp4Config, which the loader reads the
        same way); a ValueError names what tpengine cannot read."""
        method = d.get("quant_method")
        if method == "mxfp4":
            from tpengine.quantization.mxfp4 import Mxfp4Config
            return Mxfp4Config.from_hf(d)
        if method == "compressed-tensors":
            return _compressed_tensors_config(d)
        if method == "gptq":
            return _gptq_config(d)
        if method == "awq":
            return _awq_config(d)
        if method == "fp8":
            return _fp8_config(d)
        raise ValueError(f"quant_method {method!r} is not supported; tpengine reads {SUPPORTED_METHODS}")

    @property
    def tensor_suffixes(self) -> frozenset[str]:
        suffixes = set()
        for _, scheme in self.schemes:
            suffixes |= {"pack-quantized": _PACKED_SUFFIXES, "gptq": _GPTQ_SUFFIXES,
                         "awq": _AWQ_SUFFIXES, "fp8": _FP8_SUFFIXES}.get(scheme.layout, _UNPACKED_SUFFIXES)
        return frozenset(suffixes)

    @staticmethod
    def split_name(name: str) -> tuple[str, str]:
        """(module, suffix) of a checkpoint tensor: model.layers.0.mlp.down_proj.qweight -> (..down_proj, qweight)."""
        module, _, suffix = name.rpartition(".")
        return module, suffix

    @staticmethod
    def weight_name(module: str) -> str:
        """The float checkpoint's name for the tensor a module reads into: its weight."""
        return f"{module}.weight"

    def skips(self, module_name: str) -> bool:
        """Whether the checkpoint leaves this module float (ignored, not converted, or no group targets it)."""
        is_lm_head = module_name == "lm_head" or module_name.endswith(".lm_head")
        if is_lm_head and not self.lm_head_quantized and self.method != "compressed-tensors":
            return True
        if any(_matches(module_name, pattern) for pattern in self.ignore):
            return True
        if any(_has_part(module_name, part) for part in self.not_converted):
            return True
        # GPTQ's modules_in_block_to_quantize names the decoder layers' quantized linears; lm_head is outside them
        if self.quantized_only and not is_lm_head and \
                not any(_has_part(module_name, part) for part in self.quantized_only):
            return True
        return self.scheme_for(module_name) is None

    def is_quantized(self, module_name: str, suffixes_present: set[str]) -> bool:
        """Whether this module's tensors are a quantized linear: it is not skipped and carries its format's
        quantized tensor (an int-quantized or FP8 "weight" comes with a "weight_scale"; a norm's does not)."""
        expected = self.quantized_tensor(module_name)
        return expected is not None and self.split_name(expected)[1] in suffixes_present

    def quantized_tensor(self, module_name: str) -> str | None:
        """The checkpoint tensor that marks this linear as stored quantized (GPTQ's and AWQ's qweight,
        pack-quantized's weight_packed, an int- or float-quantized weight's scale), or None where the checkpoint
        leaves it float."""
        if self.skips(module_name):
            return None
        scheme = self.scheme_for(module_name)
        marker = {"pack-quantized": "weight_packed", "gptq": "qweight", "awq": "qweight"}
        return f"{module_name}.{marker.get(scheme.layout, _fp8_scale_suffix(scheme))}"

    def scheme_for(self, module_name: str) -> LinearScheme | None:
        """The scheme of the most specific target that names this module: exact name, then "re:" pattern,
        then the class "Linear" (every module the loader asks about is taken to be a linear)."""
        for rank in range(3):
            for targets, scheme in self.schemes:
                for target in targets:
                    if _target_rank(target) == rank and (rank == 2 or _matches(module_name, target)):
                        return scheme
        return None

    def read_linear(self, module_name: str, tensors: dict[str, torch.Tensor],
                    keep_fp8: bool = False) -> QuantizedWeight | Fp8Weight | torch.Tensor:
        """One whole linear's tensors, keyed by suffix, as a QuantizedWeight in the checkpoint's column order,
        or for FP8 the float32 [out, in] weight (an Fp8Weight with keep_fp8). A ValueError names the module and
        the tensor at fault."""
        scheme = self.scheme_for(module_name)
        if scheme is None or self.skips(module_name):
            raise ValueError(f"{module_name} is not quantized in this {self.method} checkpoint")
        unexpected = set(tensors) - self.tensor_suffixes
        if unexpected:
            raise ValueError(f"{module_name}: unexpected tensors {sorted(unexpected)} for {scheme.layout}; "
                             f"expected some of {sorted(self.tensor_suffixes)}")
        if scheme.weight_type == "float":
            fp8 = _read_fp8(_Tensors(module_name, tensors), scheme)
            return fp8 if keep_fp8 else fp8.dequantize()
        reader = {"pack-quantized": _read_pack_quantized, "gptq": _read_gptq, "awq": _read_awq}.get(
            scheme.layout, _read_unpacked)
        return reader(_Tensors(module_name, tensors), scheme)


def _target_rank(target: str) -> int:
    if target.startswith("re:"):
        return 1
    return 2 if target == "Linear" else 0


def _matches(module_name: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module_name) is not None
    return module_name == pattern


def _has_part(module_name: str, part: str) -> bool:
    # whole dotted parts, so that "mlp.gate" (an MoE router) does not also name mlp.gate_proj
    return f".{part}." in f".{module_name}."


# --- configs -----------------------------------------------------------------------------------------------

# the one kv_cache_scheme read: FP8 with a static per-tensor scale per layer, its k/v_proj.output_scale tensors,
# which kv_cache_dtype="fp8" takes as each layer's k_scale, v_scale (layers/attention.py)
FP8_KV_CACHE_SCHEME = {"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False}
# compressed-tensors' QuantizationArgs defaults, for the keys a config leaves out
_KV_CACHE_SCHEME_DEFAULTS = {"type": "int", "num_bits": 8, "strategy": "tensor", "dynamic": False}


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


def _fp8_config(d: dict) -> QuantizationConfig:
    """The "fp8" method (transformers' FineGrainedFP8Config, vLLM's Fp8Config): with weight_block_size, e4m3
    weights with a weight_scale_inv per block and activations quantized dynamically per 1 x block columns;
    without, one weight_scale per tensor and a dynamic or static (input_scale) per-tensor activation scale."""
    unknown = sorted(set(d) - _FP8_KNOWN_KEYS)
    if unknown:
        raise ValueError(f"fp8 quantization_config keys {unknown} are not supported; tpengine reads "
                         f"{sorted(_FP8_KNOWN_KEYS)}")
    if d.get("fmt", "e4m3") not in _FP8_FORMATS:
        raise ValueError(f"fp8 fmt {d.get('fmt')!r} is not supported; tpengine reads {_FP8_FORMATS}")
    activation_scheme = d.get("activation_scheme", "dynamic")
    if activation_scheme not in ("dynamic", "static"):
        raise ValueError(f"fp8 activation_scheme {activation_scheme!r} is not supported; use 'dynamic' or 'static'")
    block = d.get("weight_block_size")
    if block is not None:
        if not isinstance(block, (list, tuple)) or len(block) != 2 or \
                not all(isinstance(b, int) and b > 0 for b in block):
            raise ValueError(f"fp8 weight_block_size {block!r} must be [rows, columns] of positive integers")
        if activation_scheme != "dynamic":
            raise ValueError("fp8 with weight_block_size quantizes activations dynamically per group: "
                             f"activation_scheme {activation_scheme!r} is not supported with blocks")
    scheme = LinearScheme(layout="fp8", bits=8, group_size=None, symmetric=True, activation="float",
                          weight_type="float", strategy="tensor" if block is None else "block",
                          block_structure=None if block is None else tuple(block))
    not_converted = tuple(d.get("ignored_layers") or ()) + tuple(d.get("modules_to_not_convert") or ())
    return QuantizationConfig(method="fp8", schemes=((("Linear",), scheme),), not_converted=not_converted)


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


def _awq_config(d: dict) -> QuantizationConfig:
    version = str(d.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"AWQ version {d.get('version')!r} is not supported; tpengine reads 'gemm'")
    bits = d.get("bits", d.get("w_bit"))
    if bits != 4:
        raise ValueError(f"AWQ bits {bits} is not supported; tpengine reads 4 bits")
    if not d.get("zero_point", True):
        raise ValueError("AWQ zero_point false is not supported; tpengine reads AWQ with zero points")
    group_size = d.get("group_size", d.get("q_group_size", 128))
    if not isinstance(group_size, int) or (group_size <= 0 and group_size != -1):
        raise ValueError(f"AWQ group_size {group_size!r} is not supported; use a positive size or -1")
    scheme = LinearScheme(layout="awq", bits=4, group_size=None if group_size == -1 else group_size,
                          symmetric=False, activation="float", strategy="channel" if group_size == -1 else "group")
    return QuantizationConfig(method="awq", schemes=((("Linear",), scheme),),
                              not_converted=tuple(d.get("modules_to_not_convert") or ()))


# --- readers ----------------------------------------------------------------------------------------------

class _Tensors:
    """One module's tensors by suffix, with checks that name the module and tensor at fault."""

    def __init__(self, module_name: str, tensors: dict[str, torch.Tensor]):
        self.module_name, self.tensors = module_name, tensors

    def error(self, suffix: str, problem: str) -> ValueError:
        return ValueError(f"{self.module_name}.{suffix}: {problem}")

    def has(self, suffix: str) -> bool:
        return suffix in self.tensors

    def get(self, suffix: str, dtypes: tuple[torch.dtype, ...], shape: tuple[int, ...] | None = None) -> torch.Tensor:
        if suffix not in self.tensors:
            raise ValueError(f"{self.module_name}: missing tensor {suffix!r}")
        tensor = self.tensors[suffix]
        if tensor.dtype not in dtypes:
            raise self.error(suffix, f"dtype {tensor.dtype}, expected {' or '.join(map(str, dtypes))}")
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise self.error(suffix, f"shape {list(tensor.shape)}, expected {list(shape)}")
        return tensor

    def scale(self, suffix: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """A scale as float32, checked finite (read each scale through here once: the check is its cost)."""
        scale = self.get(suffix, _SCALE_DTYPES, shape)
        check_finite_scales(f"{self.module_name}.{suffix}", scale)
        return scale.float()


_SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INDEX_DTYPES = (torch.int32, torch.int64)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The unsigned `bits`-bit values packed low bits first into each int32 along `dim`, as int32, with
    32 // bits values for each word along `dim`."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    words = packed.movedim(dim, -1).unsqueeze(-1)
    values = (words >> shifts) & ((1 << bits) - 1)  # the mask undoes the sign extension of >>
    return values.flatten(-2).movedim(-1, dim)


def _group_index(tensors: _Tensors, suffix: str, in_features: int, num_groups: int,
                 group_size: int) -> torch.Tensor | None:
    """The act-order group of each column, or None where it is the plain i // group_size."""
    if not tensors.has(suffix):
        return None
    group_index = tensors.get(suffix, _INDEX_DTYPES, (in_features,)).long()
    if bool((group_index < 0).any()) or bool((group_index >= num_groups).any()):
        raise tensors.error(suffix, f"group indices outside [0, {num_groups})")
    if torch.equal(group_index, torch.arange(in_features) // group_size):
        return None
    return group_index


def _read_pack_quantized(tensors: _Tensors, scheme: LinearScheme) -> QuantizedWeight:
    shape = tensors.get("weight_shape", _INDEX_DTYPES, (2,)).tolist()
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
    group_index = _group_index(tensors, "weight_g_idx", in_features, num_groups, group_size)
    return QuantizedWeight(bits=scheme.bits, qweight=qweight, scales=scales, zeros=zeros, group_size=group_size,
                           group_index=group_index, activation=scheme.activation)


def _int_scales(tensors: _Tensors, scheme: LinearScheme, out_features: int, num_groups: int) -> torch.Tensor:
    """compressed-tensors' weight_scale as float32 [out, num_groups]; a per-tensor scale is repeated."""
    if scheme.strategy == "tensor":
        scale = tensors.scale("weight_scale")
        if scale.numel() != 1:
            raise tensors.error("weight_scale", f"shape {list(scale.shape)}, expected one per-tensor scale")
        return scale.reshape(1, 1).expand(out_features, 1).contiguous()
    return tensors.scale("weight_scale", (out_features, num_groups))


def _read_unpacked(tensors: _Tensors, scheme: LinearScheme) -> QuantizedWeight:
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


def _fp8_scale_suffix(scheme: LinearScheme) -> str:
    return "weight_scale_inv" if scheme.layout == "fp8" and scheme.strategy == "block" else "weight_scale"


def _read_fp8(tensors: _Tensors, scheme: LinearScheme) -> Fp8Weight:
    weight = tensors.get("weight", (torch.float8_e4m3fn,))
    if weight.dim() != 2:
        raise tensors.error("weight", f"shape {list(weight.shape)}, expected [out, in]")
    out_features, in_features = weight.shape
    suffix = _fp8_scale_suffix(scheme)
    if scheme.strategy == "tensor":
        scale = tensors.scale(suffix)
        if scale.numel() != 1:
            raise tensors.error(suffix, f"shape {list(scale.shape)}, expected one per-tensor scale")
        scale = scale.reshape(1, 1)
    elif scheme.strategy == "channel":
        scale = tensors.scale(suffix, (out_features, 1))
    else:
        block_rows, block_columns = scheme.block_structure
        scale = tensors.scale(suffix, (math.ceil(out_features / block_rows), math.ceil(in_features / block_columns)))
    input_scale = None
    if tensors.has("input_scale"):
        input_scale = tensors.scale("input_scale")
        if input_scale.numel() != 1:
            raise tensors.error("input_scale", f"shape {list(input_scale.shape)}, expected one per-tensor scale")
        input_scale = input_scale.reshape(1, 1)
    return Fp8Weight(weight=weight, scales=scale.contiguous(), block_size=scheme.block_structure,
                     input_scale=input_scale)


def _read_gptq(tensors: _Tensors, scheme: LinearScheme) -> QuantizedWeight:
    per_word = 32 // scheme.bits
    qweight = tensors.get("qweight", (torch.int32,))
    scales = tensors.get("scales", _SCALE_DTYPES)
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
                           group_index=_group_index(tensors, "g_idx", in_features, num_groups, group_size))


def _read_awq(tensors: _Tensors, scheme: LinearScheme) -> QuantizedWeight:
    qweight = tensors.get("qweight", (torch.int32,))
    if qweight.dim() != 2:
        raise tensors.error("qweight", f"shape {list(qweight.shape)}, expected [in, out / 8]")
    in_features, out_features = qweight.size(0), qweight.size(1) * 8
    group_size = scheme.group_size or in_features
    num_groups = math.ceil(in_features / group_size)
    scales = tensors.scale("scales", (num_groups, out_features))
    qzeros = tensors.get("qzeros", (torch.int32,), (num_groups, out_features // 8))
    # nibble i of each word holds output column _AWQ_ORDER[i] of its run of 8
    columns = torch.arange(out_features).view(-1, 8)[:, torch.argsort(torch.tensor(_AWQ_ORDER))].flatten()
    values = unpack_int32(qweight, 4, 1)[:, columns].t()
    zeros = unpack_int32(qzeros, 4, 1)[:, columns].t().float()
    return QuantizedWeight(bits=4, qweight=(values - 8).to(torch.int8).contiguous(), scales=scales.t().contiguous(),
                           zeros=(zeros - 8).contiguous(), group_size=group_size)
