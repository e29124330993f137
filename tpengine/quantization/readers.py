"""Reading one quantized linear's checkpoint tensors: Tensors checks each by suffix and names the module and tensor
at fault; the int32 unpacking and act-order group indices the integer formats share, and the FP8 reader
compressed-tensors' float-quantized and the "fp8" method share. A scheme here is config.py's LinearScheme."""
import math

import torch

from tpengine.quantization.fp8 import Fp8Weight
from tpengine.quantization.weights import check_finite_scales

SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


class Tensors:
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
        scale = self.get(suffix, SCALE_DTYPES, shape)
        check_finite_scales(f"{self.module_name}.{suffix}", scale)
        return scale.float()



def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The unsigned `bits`-bit values packed low bits first into each int32 along `dim`, as int32, with
    32 // bits values for each word along `dim`."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    words = packed.movedim(dim, -1).unsqueeze(-1)
    values = (words >> shifts) & ((1 << bits) - 1)  # the mask undoes the sign extension of >>
    return values.flatten(-2).movedim(-1, dim)


def read_group_index(tensors: Tensors, suffix: str, in_features: int, num_groups: int,
                 group_size: int) -> torch.Tensor | None:
    """The act-order group of each column, or None where it is the plain i // group_size."""
    if not tensors.has(suffix):
        return None
    group_index = tensors.get(suffix, INDEX_DTYPES, (in_features,)).long()
    if bool((group_index < 0).any()) or bool((group_index >= num_groups).any()):
        raise tensors.error(suffix, f"group indices outside [0, {num_groups})")
    if torch.equal(group_index, torch.arange(in_features) // group_size):
        return None
    return group_index


def fp8_scale_suffix(scheme) -> str:
    # the "fp8" method's block scales are named weight_scale_inv (they multiply, despite the name)
    return "weight_scale_inv" if scheme.layout == "fp8" and scheme.strategy == "block" else "weight_scale"


def read_fp8(tensors: Tensors, scheme) -> Fp8Weight:
    """An FP8 linear's e4m3 weight with its scales (per tensor, channel or block: the scheme's strategy) and its
    input_scale, if it has one."""
    weight = tensors.get("weight", (torch.float8_e4m3fn,))
    if weight.dim() != 2:
        raise tensors.error("weight", f"shape {list(weight.shape)}, expected [out, in]")
    out_features, in_features = weight.shape
    suffix = fp8_scale_suffix(scheme)
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
