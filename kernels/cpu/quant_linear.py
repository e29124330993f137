"""The C++ int8/int4 linear (quant_linear.cpp), built on first use by kernels/cpu/build.py and loaded as the torch
ops `torch.ops.tpengine_cpu.quant_linear` and `quant_dequantize_rows`, the weight packing they read, and the
reference they are measured against.

The weight is QuantizedWeight's (tpengine/quantization/weights.py): w[o, i] = scales[o, g(i)] * (qweight[o, i] -
zeros[o, g(i)]) with groups of group_size contiguous columns. Activation "float" multiplies x as it is (float32
FMA chains); "int8" quantizes each row of x on the fly and sums integers per group (exact), then combines groups
in float32 in an order quant_linear_reference follows to the bit.

Resident bytes per parameter (bfloat16 is 2): int8 1 + 5 / group (float32 scale and int8 zero per group and output),
int4 0.5 + 5 / group; per output channel the scales are negligible: int8 1.0 (0.50x), int4 0.5 (0.25x); groups of
128: int8 1.04 (0.52x), int4 0.54 (0.27x); groups of 32: int4 0.66 (0.33x).
"""
import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from tpengine.kernels.cpu.build import build_and_load, build_and_load_or_warn
from tpengine.kernels.cpu.huge_pages import on_huge_pages

BLOCK_OUT = 8  # output features per packed block (quant_linear.cpp)
STEP_INPUTS = 4  # inputs of each output in one 32-byte step
GROUP_MULTIPLE = 8  # a group of several per row is a whole number of int4 byte pairs
MAX_GROUP_COLUMNS = 65536  # an int8 group's integer sum stays within int32: 65536 * 128 * 127 * 2 < 2^31
ACTIVATIONS = ("float", "int8")
# the int8 path's float32 products and sums are rounded one by one, as the reference's: no FMA may merge them
EXTRA_FLAGS = ("-ffp-contract=off",)


class PackedQuantWeight(NamedTuple):
    weight: torch.Tensor  # uint8 [blocks, bytes per block]: steps [in_padded / 4][8 outputs][4 inputs], int4 two a byte
    scales: torch.Tensor  # float32 [blocks, groups, 8]
    zeros: torch.Tensor  # int8 [blocks, groups, 8]: zero + 8 for int4 (the stored unsigned value's offset), zero for int8
    out_features: int
    in_features: int
    bits: int
    group_size: int  # the checkpoint's: in_features for one group per output channel
    group_columns: int  # the packed group: group_size, or in_features padded to a multiple of 8 for one group
    activation: str
    correct_zeros: bool  # the kernel subtracts zero * sum(x) per group: int4, or int8 with zeros

    def resident_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scales, self.zeros))


@functools.cache
def load() -> None:
    """Build the ops if this machine has no build of them yet, then load them; RuntimeError saying why not."""
    build_and_load("quant_linear.cpp", EXTRA_FLAGS)


@functools.cache
def available() -> bool:
    """Whether the ops build and load here; the first failure is logged once."""
    return build_and_load_or_warn("quant_linear.cpp", "no quantized linear runs on this CPU", EXTRA_FLAGS)


def _check(qweight, scales, zeros, bits, group_size, activation) -> int:
    """ValueError naming what is wrong with a weight to pack; returns the number of groups."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, not {bits}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, not {activation!r}")
    if qweight.dtype != torch.int8 or qweight.dim() != 2:
        raise ValueError(f"qweight must be int8 [out, in], not {qweight.dtype} {tuple(qweight.shape)}")
    out_features, in_features = qweight.shape
    low, high = -2 ** (bits - 1), 2 ** (bits - 1) - 1
    if bits == 4 and qweight.numel() and not (low <= int(qweight.min()) and int(qweight.max()) <= high):
        raise ValueError(f"int4 qweight values must lie in [{low}, {high}]")
    num_groups = scales.size(1) if scales.dim() == 2 else -1
    if scales.dtype != torch.float32 or scales.dim() != 2 or scales.size(0) != out_features:
        raise ValueError(f"scales must be float32 [out={out_features}, groups], not {scales.dtype} {tuple(scales.shape)}")
    if num_groups == 1:
        if group_size < in_features:
            raise ValueError(f"one group of scales covers group_size {group_size} < in_features {in_features}")
    elif group_size * num_groups != in_features:
        raise ValueError(f"{num_groups} groups of {group_size} columns do not cover in_features {in_features} "
                         "(in_features must be a multiple of group_size)")
    elif group_size % GROUP_MULTIPLE:
        raise ValueError(f"group_size {group_size} must be a multiple of {GROUP_MULTIPLE}")
    if min(group_size, in_features) > MAX_GROUP_COLUMNS:
        raise ValueError(f"a group of {min(group_size, in_features)} columns is over the kernel's {MAX_GROUP_COLUMNS}")
    if zeros is not None:
        offset = 8 if bits == 4 else 0
        if zeros.shape != scales.shape or zeros.dtype != torch.float32:
            raise ValueError(f"zeros must be float32 shaped like scales {tuple(scales.shape)}")
        if not bool((zeros == zeros.round()).all()) or zeros.numel() and not (
                -128 <= float(zeros.min()) + offset and float(zeros.max()) + offset <= 127):
            raise ValueError(f"zeros must be whole numbers in [{-128 - offset}, {127 - offset}]")
    return num_groups


def pack(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int, group_size: int,
         activation: str) -> PackedQuantWeight:
    """A QuantizedWeight's tensors (contiguous groups) in the kernel's layout, once at load; ValueError naming a
    tensor or argument the kernel cannot take."""
    num_groups = _check(qweight, scales, zeros, bits, group_size, activation)
    out_features, in_features = qweight.shape
    offset = 8 if bits == 4 else 0
    in_padded = in_features if num_groups > 1 else -(-in_features // GROUP_MULTIPLE) * GROUP_MULTIPLE
    pad_out = -out_features % BLOCK_OUT
    blocks = (out_features + pad_out) // BLOCK_OUT
    # padded columns meet x's zeros, padded rows have scale 0: neither adds anything
    q = F.pad(qweight.to(torch.int16) + offset, (0, in_padded - in_features, 0, pad_out), value=offset)
    if bits == 8:
        steps = q.view(blocks, BLOCK_OUT, in_padded // STEP_INPUTS, STEP_INPUTS).permute(0, 2, 1, 3)
        weight = steps.to(torch.int8).contiguous().view(torch.uint8).reshape(blocks, -1)
    else:  # step 2p in the low nibbles, step 2p + 1 in the high ones
        pairs = q.view(blocks, BLOCK_OUT, in_padded // 8, 2, STEP_INPUTS).permute(0, 2, 3, 1, 4)
        weight = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).to(torch.uint8).contiguous().reshape(blocks, -1)
    zero_points = torch.zeros_like(scales) if zeros is None else zeros

    def per_block(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return F.pad(t, (0, 0, 0, pad_out)).view(blocks, BLOCK_OUT, num_groups).permute(0, 2, 1).to(dtype).contiguous()

    return PackedQuantWeight(on_huge_pages(weight), per_block(scales, torch.float32),
                             per_block(zero_points + offset, torch.int8),
                             out_features, in_features, bits, group_size,
                             in_padded if num_groups == 1 else group_size, activation, bits == 4 or zeros is not None)


def quant_linear(x: torch.Tensor, packed: PackedQuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] (float32 or bfloat16) @ W^T (+ bias) -> [..., out] in x's dtype; needs available()."""
    load()
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"quant_linear takes float32 or bfloat16 x, not {x.dtype}")
    if x.size(-1) != packed.in_features:
        raise ValueError(f"x has {x.size(-1)} features, the weight takes {packed.in_features}")
    flat = x.dim() == 2  # the decoder's [tokens, features]: no views in or out (each costs microseconds a call)
    rows = x if flat else x.reshape(-1, packed.in_features)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if bias is not None and bias.dtype != torch.float32:
        bias = bias.float()
    # a bfloat16 x goes in as it is and its result comes out rounded once to bfloat16: no conversions around the op
    out = torch.ops.tpengine_cpu.quant_linear(rows, packed.weight, packed.scales, packed.zeros, packed.out_features,
                                              packed.in_features, packed.bits, packed.group_columns,
                                              packed.activation == "int8", packed.correct_zeros, bias)
    return out if flat else out.view(*x.shape[:-1], packed.out_features)


def dequantize_rows(packed: PackedQuantWeight, rows: torch.Tensor) -> torch.Tensor:
    """float32 [n, in]: the weight's rows (output features) `rows`, exactly as QuantizedWeight.dequantize gives them
    (a quantized embedding table gathered by token ids)."""
    load()
    if rows.dtype != torch.int64 or rows.dim() != 1:
        raise ValueError(f"rows must be an int64 vector, not {rows.dtype} {tuple(rows.shape)}")
    return torch.ops.tpengine_cpu.quant_dequantize_rows(packed.weight, packed.scales, packed.zeros,
                                                        packed.out_features, packed.in_features, packed.bits,
                                                        packed.group_columns, rows)


def quant_linear_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                           group_size: int, activation: str) -> torch.Tensor:
    """What quant_linear computes, without bias, as float32 [..., out].

    "float": x @ W^T with W = scales * (qweight - zeros), the product exact (float64) and rounded once; the kernel's
    FMA chains differ from it by float32 accumulation error.
    "int8": bit for bit the kernel's result. Per row sx = max|x| / 127 and xq = round_half_even(x / sx) clamped to
    [-127, 127] (0 for a zero row); per group g the exact integer d_g = sum(qweight * xq) - zeros * sum(xq); then in
    float32, each product and sum rounded: total = 0; total = total + scales[:, g] * float32(d_g) for g in order;
    out = total * sx.
    """
    in_features = qweight.size(1)
    xf = x.float().reshape(-1, in_features)
    groups = [(g * group_size, min(in_features, (g + 1) * group_size)) for g in range(scales.size(1))]
    if activation == "float":
        q = qweight.double()
        weight = torch.cat([(q[:, a:b] - (0 if zeros is None else zeros[:, g:g + 1].double()))
                            * scales[:, g:g + 1].double() for g, (a, b) in enumerate(groups)], dim=1)
        out = (xf.double() @ weight.T).float()
    elif activation == "int8":
        sx = xf.abs().amax(dim=1, keepdim=True) / 127
        xq = torch.where(sx > 0, (xf / sx).round().clamp(-127, 127), torch.zeros_like(xf)).double()
        total = torch.zeros(xf.size(0), qweight.size(0))
        for g, (a, b) in enumerate(groups):
            d = xq[:, a:b] @ qweight[:, a:b].double().T  # whole numbers below 2^53: exact
            if zeros is not None:
                d = d - xq[:, a:b].sum(dim=1, keepdim=True) * zeros[:, g].double()
            total = total + scales[:, g] * d.float()
        out = total * sx
    else:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, not {activation!r}")
    return out.view(*x.shape[:-1], qweight.size(0))
