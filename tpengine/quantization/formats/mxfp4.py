"""MXFP4 checkpoints (gpt-oss's `quant_method: "mxfp4"`): the expert projections stored as `<name>_blocks` and
`<name>_scales` (quantization/mxfp4.py's format), read into float tensors as they load; everything else in the
checkpoint is stored float."""
from dataclasses import dataclass

import torch

from tpengine.quantization.config import register_format
from tpengine.quantization.mxfp4 import dequantize_mxfp4
from tpengine.quantization.weights import check_finite_scales

_KNOWN_KEYS = {"quant_method", "modules_to_not_convert", "dequantize"}
_EXPERT_PROJECTIONS = (".experts.gate_up_proj", ".experts.down_proj")


@dataclass(frozen=True)
class Mxfp4Config:
    """The loader's view of an MXFP4 checkpoint (the interface of quantization.config.QuantizationConfig): a
    "module" is one expert projection, `...mlp.experts.gate_up_proj`, its tensors the suffixes blocks and
    scales; it reads into the float tensor a bf16 checkpoint stores under that name."""
    method: str = "mxfp4"
    tensor_suffixes: frozenset = frozenset({"blocks", "scales"})

    @classmethod
    def from_hf(cls, d: dict) -> "Mxfp4Config":
        """From a config.json's quantization_config; a ValueError names the keys tpengine does not read."""
        unknown = sorted(set(d) - _KNOWN_KEYS)
        if unknown:
            raise ValueError(f"mxfp4 quantization_config keys {unknown} are not supported; tpengine reads "
                             f"{sorted(_KNOWN_KEYS)}")
        return cls()

    def describe(self) -> str:
        return "mxfp4 experts (e2m1 values, an e8m0 scale per 32), dequantized at load"

    @staticmethod
    def split_name(name: str) -> tuple[str, str]:
        """(module, suffix) of a checkpoint tensor: gate_up_proj_blocks -> (gate_up_proj, blocks)."""
        module, _, suffix = name.rpartition("_")
        return (module, suffix) if suffix in ("blocks", "scales") else (name, "")

    @staticmethod
    def weight_name(module: str) -> str:
        """The float checkpoint's name for the tensor a module reads into."""
        return module

    def skips(self, module_name: str) -> bool:
        return False  # whatever has blocks and scales is quantized; everything else is stored float

    def is_quantized(self, module_name: str, suffixes_present: set[str]) -> bool:
        return "blocks" in suffixes_present

    def quantized_tensor(self, module_name: str) -> str | None:
        """The tensor an expert projection is stored in (MXFP4 quantizes the experts only), else None."""
        return f"{module_name}_blocks" if module_name.endswith(_EXPERT_PROJECTIONS) else None

    def read_linear(self, module_name: str, tensors: dict[str, torch.Tensor], keep_fp8: bool = False) -> torch.Tensor:
        """The float tensor (keep_fp8 is QuantizationConfig's: MXFP4 is always read into floats)."""
        missing = sorted(self.tensor_suffixes - set(tensors))
        if missing:
            raise ValueError(f"{module_name}: missing tensor {missing[0]!r}")
        check_finite_scales(f"{module_name}_scales", tensors["scales"])
        # bfloat16 holds every value float32 does (an FP4 value times 2^-127..2^127: at most 2 significant bits,
        # float32's exponent range), in half the memory; the weight loader casts it to the model's dtype
        return dequantize_mxfp4(tensors["blocks"], tensors["scales"], torch.bfloat16)


register_format("mxfp4")(Mxfp4Config.from_hf)
