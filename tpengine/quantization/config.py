"""The core every checkpoint format reads through: QuantizationConfig (which linears a checkpoint quantizes, and how)
and the registries each format module (quantization/formats/) adds itself to, keyed by its `quant_method` and by the
storage layouts it reads. tpengine/quantization/__init__.py imports the formats, so importing this module finds them
registered.

The loader groups a checkpoint's tensors by module prefix and asks, for each module:
    config = QuantizationConfig.from_hf(hf_config["quantization_config"])   # ValueError: what is unsupported
    config.skips(module_name) -> bool          # left float by the checkpoint (ignore, lm_head, ...)
    config.is_quantized(module_name, suffixes_present) -> bool
    config.quantized_tensor(module_name) -> str | None   # what a float weight there lacks (a float checkpoint)
    config.read_linear(module_name, tensors_by_suffix) -> QuantizedWeight | torch.Tensor
`tensor_suffixes` names every suffix a quantized linear of this checkpoint may have (a "bias" stays the
loader's); a module is quantized when it is not skipped and carries its layout's marker tensor, not by its names
alone. read_linear takes one whole, unsharded linear and returns its QuantizedWeight; an FP8 linear is read as its
float32 [out, in] weight, its input_scale unused (the CPU converts FP8 at load), or with keep_fp8 as an Fp8Weight
with its scales and input_scale (a platform with FP8 matmuls). Every scale read must be finite:
check_finite_scales (weights.py) names the tensor that is not.
"""
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tpengine.quantization.fp8 import Fp8Weight
from tpengine.quantization.readers import Tensors
from tpengine.quantization.weights import Activation, QuantizedWeight

# quant_method -> its format's reader of a config.json's quantization_config (register_format)
FORMATS: dict[str, Callable[[dict], object]] = {}


def register_format(method: str):
    """Decorator: fn(quantization_config dict) reads checkpoints whose quant_method is `method`."""
    def register(read_config):
        FORMATS[method] = read_config
        return read_config
    return register


def supported_methods() -> str:
    """The quant_methods tpengine reads, for an error message: "a, b and c"."""
    methods = list(FORMATS)
    return ", ".join(methods[:-1]) + " and " + methods[-1] if len(methods) > 1 else "".join(methods)


@dataclass(frozen=True)
class LinearScheme:
    """How one set of linears is stored: `layout` names its Layout (LAYOUTS)."""
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
class Layout:
    """How one storage layout keeps a linear's tensors (register_layout): the suffixes it may have, the one whose
    presence marks the linear stored quantized (a str, or the scheme's own), and its reader."""
    suffixes: frozenset[str]
    marker: str | Callable[[LinearScheme], str]
    read: Callable[[Tensors, LinearScheme], QuantizedWeight | Fp8Weight]

    def marker_of(self, scheme: LinearScheme) -> str:
        return self.marker if isinstance(self.marker, str) else self.marker(scheme)


LAYOUTS: dict[str, Layout] = {}  # LinearScheme.layout -> its Layout


def register_layout(name: str, layout: Layout) -> None:
    LAYOUTS[name] = layout


@dataclass(frozen=True)
class QuantizationConfig:
    method: str  # the checkpoint's quant_method: "compressed-tensors", "fp8", "gptq" or "awq"
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
        if method not in FORMATS:
            raise ValueError(f"quant_method {method!r} is not supported; tpengine reads {supported_methods()}")
        return FORMATS[method](d)

    @property
    def tensor_suffixes(self) -> frozenset[str]:
        return frozenset().union(*(LAYOUTS[scheme.layout].suffixes for _, scheme in self.schemes))

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
        return f"{module_name}.{LAYOUTS[scheme.layout].marker_of(scheme)}"

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
        weight = LAYOUTS[scheme.layout].read(Tensors(module_name, tensors), scheme)
        return weight.dequantize() if isinstance(weight, Fp8Weight) and not keep_fp8 else weight


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


