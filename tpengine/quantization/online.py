"""Quantizing a float weight at load, for a model whose checkpoint is float:
    quantize_weight(weight [out, in], bits, group_size=None, activation="float") -> QuantizedWeight
Symmetric round-to-nearest (half to even): int8 with one scale per output channel (absmax / 127, values
in [-127, 127]), int4 with one scale per group of 128 input features by default (absmax / 7, values in
[-8, 7]). A given group_size groups either width.
"""
import torch

from tpengine.quantization.weights import Activation, QuantizedWeight

DEFAULT_INT4_GROUP_SIZE = 128


def quantize_weight(weight: torch.Tensor, bits: int, group_size: int | None = None,
                    activation: Activation = "float") -> QuantizedWeight:
    if bits not in (4, 8):
        raise ValueError(f"online quantization to {bits} bits is not supported; use 4 or 8")
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"online quantization takes a float [out, in] weight, not {weight.dtype} "
                         f"{list(weight.shape)}")
    out_features, in_features = weight.shape
    if group_size is None:
        group_size = in_features if bits == 8 else DEFAULT_INT4_GROUP_SIZE
    if group_size <= 0 or in_features % group_size:
        raise ValueError(f"in_features {in_features} is not a multiple of the quantization group size "
                         f"{group_size}")
    largest = (1 << (bits - 1)) - 1  # 127 or 7: symmetric, so -128 (-8) is reached only by rounding
    groups = weight.float().reshape(out_features, in_features // group_size, group_size)
    absmax = groups.abs().amax(dim=2)
    scales = absmax / largest
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero group: 0 / 1, not 0 / 0
    qweight = torch.round(groups / scales.unsqueeze(2)).clamp(-largest - 1 if bits == 4 else -largest, largest)
    return QuantizedWeight(bits=bits, qweight=qweight.to(torch.int8).reshape(out_features, in_features),
                           scales=scales, zeros=None, group_size=group_size, activation=activation)
