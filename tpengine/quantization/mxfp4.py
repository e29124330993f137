"""MXFP4 checkpoints (gpt-oss's `quant_method: "mxfp4"`): each expert projection stored as `<name>_blocks` and
`<name>_scales`, dequantized on the CPU as it loads.

The format, as transformers' integrations/mxfp4.py (convert_moe_packed_tensors) reads it: a projection whose
float form is [experts, in, out] is stored transposed, each [out] row of `in` values cut into groups of 32:
    blocks uint8 [experts, out, in / 32, 16]: two FP4 (e2m1) values a byte, the even index in the low nibble;
    scales uint8 [experts, out, in / 32]: one e8m0 exponent a group, 2^(scale - 127).
An e2m1 nibble is a sign bit over 3 bits indexing FP4_VALUES' magnitudes. Everything else in the checkpoint
(attention, router, embeddings, biases: transformers' modules_to_not_convert) is stored float and loads as is.
"""
from dataclasses import dataclass

import torch

from tpengine.quantization.weights import check_finite_scales

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP_SIZE = 32  # values per scale
_KNOWN_KEYS = {"quant_method", "modules_to_not_convert", "dequantize"}
_EXPERT_PROJECTIONS = (".experts.gate_up_proj", ".experts.down_proj")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float [experts, in, out] tensor that blocks [experts, out, in / 32, 16] and scales [experts, out,
    in / 32] stand for (exact in float32: every value is an FP4 value times a power of two)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 3 or blocks.size(-1) != GROUP_SIZE // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not match: blocks "
                         f"must be scales' shape + [{GROUP_SIZE // 2}]")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    *experts, rows, groups, _ = blocks.shape
    out = torch.empty(*experts, groups * GROUP_SIZE, rows, dtype=dtype, device=blocks.device)
    # one expert at a time: a projection's float32 values exist only one expert's worth at once
    for block, scale, dest in zip(blocks.reshape(-1, rows, groups, GROUP_SIZE // 2), scales.reshape(-1, rows, groups),
                                  out.view(-1, groups * GROUP_SIZE, rows)):
        values = torch.stack([lut[(block & 0x0F).long()], lut[(block >> 4).long()]], dim=-1)  # low nibble first
        values = torch.ldexp(values.flatten(-2), scale.to(torch.int32).unsqueeze(-1) - 127)
        dest.copy_(values.flatten(-2).t())
    return out


@dataclass(frozen=True)
class Mxfp4Config:
    """The loader's view of an MXFP4 checkpoint (the interface of quantization.config.QuantizationConfig): a
    "module" is one expert projection, `...mlp.experts.gate_up_proj`, its tensors the suffixes blocks and
    scales; it reads into the float tensor a bf16 checkpoint stores under that name."""
    method: str = "mxfp4"
    tensor_suffixes: frozenset = frozenset({"blocks", "scales"})

    @classmethod
    def from_hf(cls, d: dict) -> "Mxfp4Config":
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
