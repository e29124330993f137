"""A quantized weight in the one form every checkpoint format is read into and every platform packs from.

Readers (compressed-tensors, GPTQ, AWQ, online quantization) turn a checkpoint's tensors for one whole
[out, in] linear into a QuantizedWeight in the checkpoint's column order; the layer takes its shard with
`rows` or `columns` and joins packed projections (q/k/v, gate/up) with `cat_rows`; a platform packs the
result of `with_contiguous_groups` once, for its kernels.

The value it stands for: w[o, i] = scales[o, g(i)] * (qweight[o, i] - zeros[o, g(i)]) (zeros 0 when None),
with g(i) = group_index[i], or i // group_size when group_index is None.
"""
from dataclasses import dataclass, replace
from typing import Literal

import torch

# how a linear treats its input: as is ("float"), or quantized to int8 per token on the fly, symmetric
# ("int8": W8A8 checkpoints, and the CPU's integer dot products)
Activation = Literal["float", "int8"]


@dataclass(frozen=True)
class QuantizedWeight:
    bits: int  # 4 or 8: qweight's values lie in [-2^(bits-1), 2^(bits-1) - 1]
    qweight: torch.Tensor  # int8 [out, in], signed (an unsigned format's values less 2^(bits-1))
    scales: torch.Tensor  # float32 [out, num_groups]
    zeros: torch.Tensor | None  # float32 [out, num_groups], whole numbers on qweight's signed scale; None: 0
    group_size: int  # columns per group; `in` for one group per output channel
    group_index: torch.Tensor | None = None  # int64 [in]: column i's group, where groups are not runs (act order)
    activation: Activation = "float"

    def __post_init__(self):
        out_features, in_features = self.qweight.shape
        assert self.bits in (4, 8) and self.qweight.dtype == torch.int8
        assert self.scales.dtype == torch.float32 and self.scales.size(0) == out_features
        assert self.zeros is None or self.zeros.shape == self.scales.shape
        assert self.group_index is not None or self.scales.size(1) == -(-in_features // self.group_size)

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    def to(self, device: torch.device) -> "QuantizedWeight":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return replace(self, qweight=move(self.qweight), scales=move(self.scales), zeros=move(self.zeros),
                       group_index=move(self.group_index))

    def column_groups(self) -> torch.Tensor:
        """int64 [in]: the group of each column."""
        if self.group_index is not None:
            return self.group_index
        return torch.arange(self.qweight.size(1), device=self.qweight.device) // self.group_size

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float [out, in] weight this stands for, computed in float32: the reference every kernel and
        every float checkpoint written from a quantized one is measured against."""
        groups = self.column_groups()
        q = self.qweight.float()
        if self.zeros is not None:
            q = q - self.zeros[:, groups]
        return (q * self.scales[:, groups]).to(dtype)

    def rows(self, start: int, length: int) -> "QuantizedWeight":
        """Output features start..start+length (a column-parallel shard): each row keeps its own scales."""
        return replace(self, qweight=self.qweight.narrow(0, start, length), scales=self.scales.narrow(0, start, length),
                       zeros=None if self.zeros is None else self.zeros.narrow(0, start, length))

    def columns(self, start: int, length: int, num_shards: int) -> "QuantizedWeight":
        """Input features start..start+length, one of num_shards equal shards (a row-parallel shard). Groups in
        runs must not be split: a ValueError names the shard's columns and the group size."""
        if self.group_index is not None:  # act order: the shard keeps every group's scales, its columns their groups
            return replace(self, qweight=self.qweight.narrow(1, start, length),
                           group_index=self.group_index.narrow(0, start, length))
        if self.scales.size(1) == 1:  # one group per output channel: every shard shares it
            return replace(self, qweight=self.qweight.narrow(1, start, length), group_size=length)
        if start % self.group_size or length % self.group_size:
            raise ValueError(f"tensor parallel size {num_shards} splits a quantization group: each rank takes "
                             f"{length} input features, not a multiple of the group size {self.group_size}")
        first, count = start // self.group_size, length // self.group_size
        return replace(self, qweight=self.qweight.narrow(1, start, length),
                       scales=self.scales.narrow(1, first, count),
                       zeros=None if self.zeros is None else self.zeros.narrow(1, first, count))

    def with_contiguous_groups(self) -> tuple["QuantizedWeight", torch.Tensor | None]:
        """(this weight with every group one run of group_size columns, the input column each of its columns
        multiplies, or None where that is the identity). Act-order columns are sorted by group; a group with
        fewer columns than group_size (a row-parallel shard's) is padded with columns that weigh zero."""
        if self.group_index is None:
            return self, None
        num_groups = self.scales.size(1)
        counts = torch.bincount(self.group_index, minlength=num_groups)
        present = (counts > 0).nonzero().flatten()
        if bool((counts[present] == self.group_size).all()):
            order = torch.argsort(self.group_index, stable=True)
            return replace(self, qweight=self.qweight[:, order].contiguous(), scales=self.scales[:, present],
                           zeros=None if self.zeros is None else self.zeros[:, present], group_index=None), order
        # pad each present group to group_size columns; a pad column reads input 0 with the zero point as its value
        order = torch.argsort(self.group_index, stable=True)
        size = self.group_size
        # on the weight's device: a GPU kernel reads slots as its column order
        slots = torch.zeros(len(present) * size, dtype=torch.int64, device=self.qweight.device)
        real = torch.zeros(len(present) * size, dtype=torch.bool, device=self.qweight.device)
        start = 0
        for slot, group in enumerate(present.tolist()):
            count = int(counts[group])
            slots[slot * size:slot * size + count] = order[start:start + count]
            real[slot * size:slot * size + count] = True
            start += count
        qweight = self.qweight[:, slots]
        pad = self.zeros[:, present].repeat_interleave(size, dim=1).to(torch.int8) if self.zeros is not None \
            else torch.zeros_like(qweight)
        qweight = torch.where(real, qweight, pad).contiguous()
        return replace(self, qweight=qweight, scales=self.scales[:, present],
                       zeros=None if self.zeros is None else self.zeros[:, present], group_index=None), slots


def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Packed projections (q/k/v, gate/up) as one weight, each part keeping its own scales. They must agree on
    groups and activation; act-order parts must share one group_index (GPTQ quantizes them alike). Parts of 4 and
    8 bits (a GGUF file's Q4_0 q beside its Q8_0 k and v) join as 8 bits: an int4 value is an int8 one, exactly."""
    first = parts[0]
    for part in parts[1:]:
        # symmetric values are signed at any width; with zero points a width is its own unsigned range
        widths_join = part.bits == first.bits or first.zeros is None
        if (part.group_size, part.activation, part.zeros is None) != \
                (first.group_size, first.activation, first.zeros is None) or not widths_join:
            raise ValueError("the packed projections of one layer are quantized differently: "
                             f"{(first.bits, first.group_size, first.activation)} and "
                             f"{(part.bits, part.group_size, part.activation)}")
        if (part.group_index is None) != (first.group_index is None) or (
                part.group_index is not None and not torch.equal(part.group_index, first.group_index)):
            raise ValueError("the packed projections of one layer have different act-order group indices (g_idx)")
    return replace(first, bits=max(p.bits for p in parts), qweight=torch.cat([p.qweight for p in parts]),
                   scales=torch.cat([p.scales for p in parts]),
                   zeros=None if first.zeros is None else torch.cat([p.zeros for p in parts]))


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values, float32 scales [..., 1]) of x quantized per token (its last dimension), symmetric: the
    scale is the row's largest magnitude over 127, values rounded half to even; an all-zero row gets scale 1.
    How an "int8" activation linear sees its input."""
    x = x.float()
    scales = x.abs().amax(dim=-1, keepdim=True) / 127
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    return torch.round(x / scales).clamp_(-127, 127).to(torch.int8), scales


def check_finite_scales(name: str, scales: torch.Tensor) -> None:
    """A ValueError naming the checkpoint tensor when any of its scales is NaN or Inf (uint8 scales are e8m0
    exponents, MXFP4's, whose 0xFF is NaN): a model loaded with one would answer every request with nothing."""
    non_finite = scales == 0xFF if scales.dtype == torch.uint8 else ~torch.isfinite(scales)
    count = int(non_finite.sum())
    if count:
        raise ValueError(f"{name} has {count} non-finite values (NaN or Inf): the checkpoint is corrupt")
