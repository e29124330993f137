"""A quantized weight in the one form every checkpoint format is read into and every platform packs from.

Readers (compressed-tensors, GPTQ, AWQ, online quantization) turn a checkpoint's tensors for one whole
[out, in] linear into a QuantizedWeight in the checkpoint's column order; the layer takes its shard with
`rows` or `columns` and joins packed projections (q/k/v, gate/up) with `cat_rows`; a platform packs the
result of `with_contiguous_groups` once, for its kernels.

The value it stands for: w[o, i] = scales[o, g(i)] * (qweight[o, i] - zeros[o, g(i)]) - minimums[o, g(i)] (zeros and
minimums 0 when None), with g(i) = group_index[i], or i // group_size when group_index is None. The float minimum per
group is GGUF's (Q4_1, Q5_1 and the K-quants with a min: w = d * q - m); no kernel reads it: a platform packs the
weight without it and subtracts each row's group sums of x times the minimums (platforms/packed.py's
MinimumCorrected).
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
    minimums: torch.Tensor | None = None  # float32 [out, num_groups], subtracted after scaling; None: 0

    def __post_init__(self):
        out_features, in_features = self.qweight.shape
        assert self.bits in (4, 8) and self.qweight.dtype == torch.int8
        assert self.scales.dtype == torch.float32 and self.scales.size(0) == out_features
        assert self.zeros is None or self.zeros.shape == self.scales.shape
        assert self.group_index is not None or self.scales.size(1) == -(-in_features // self.group_size)
        # minimums come from GGUF files, whose groups are runs: act order with minimums is no form we read
        assert self.minimums is None or (self.minimums.shape == self.scales.shape and self.group_index is None
                                         and self.minimums.dtype == torch.float32)

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    def to(self, device: torch.device) -> "QuantizedWeight":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return replace(self, qweight=move(self.qweight), scales=move(self.scales), zeros=move(self.zeros),
                       group_index=move(self.group_index), minimums=move(self.minimums))

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
        weight = q * self.scales[:, groups]
        if self.minimums is not None:  # scaled first, then less the minimum: GGUF's d * q - m, rounded as there
            weight = weight - self.minimums[:, groups]
        return weight.to(dtype)

    def rows(self, start: int, length: int) -> "QuantizedWeight":
        """Output features start..start+length (a column-parallel shard): each row keeps its own scales."""
        narrow = lambda t: None if t is None else t.narrow(0, start, length)  # noqa: E731
        return replace(self, qweight=narrow(self.qweight), scales=narrow(self.scales), zeros=narrow(self.zeros),
                       minimums=narrow(self.minimums))

    def columns(self, start: int, length: int, num_shards: int) -> "QuantizedWeight":
        """Input features start..start+length, one of num_shards equal shards (a row-parallel shard). Groups in
        runs must not be split: a ValueError names the shard's columns and the group size."""
        if self.group_index is not None:  # act order: the shard keeps every group's scales, its columns their groups
            return replace(self, qweight=self.qweight.narrow(1, start, length),
                           group_index=self.group_index.narrow(0, start, length))
        if self.scales.size(1) == 1:  # one group per output channel: every shard shares it (a minimum too: each
            # shard subtracts it times its own columns' sum of x, and the shards' results are summed)
            return replace(self, qweight=self.qweight.narrow(1, start, length), group_size=length)
        if start % self.group_size or length % self.group_size:
            raise ValueError(f"tensor parallel size {num_shards} splits a quantization group: each rank takes "
                             f"{length} input features, not a multiple of the group size {self.group_size}")
        first, count = start // self.group_size, length // self.group_size
        narrow = lambda t: None if t is None else t.narrow(1, first, count)  # noqa: E731
        return replace(self, qweight=self.qweight.narrow(1, start, length), scales=narrow(self.scales),
                       zeros=narrow(self.zeros), minimums=narrow(self.minimums))

    def regrouped(self, group_size: int) -> "QuantizedWeight":
        """The same weight in groups of group_size columns, which divides this one's: each group's scale, zero and
        minimum repeated over its smaller groups (exact). Groups in runs only."""
        assert self.group_index is None and self.group_size % group_size == 0
        if group_size == self.group_size:
            return self
        num_groups = -(-self.qweight.size(1) // group_size)  # a short last group may need fewer
        repeat = lambda t: None if t is None else \
            t.repeat_interleave(self.group_size // group_size, dim=1)[:, :num_groups].contiguous()  # noqa: E731
        return replace(self, scales=repeat(self.scales), zeros=repeat(self.zeros), minimums=repeat(self.minimums),
                       group_size=group_size)

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
    """Packed projections (q/k/v, gate/up) as one weight, each part keeping its own scales, all exactly. They must
    agree on activation; act-order parts must share one group_index (GPTQ quantizes them alike). Groups in runs of
    different sizes join in the smallest, where it divides the others (a GGUF file's Q4_K q, groups of 32, beside
    its Q6_K v, groups of 16); parts of 4 and 8 bits join as 8 bits (an int4 value is an int8 one); a part without
    zero points or minimums takes zeros beside one with them."""
    first = parts[0]
    group_size = min(p.group_size for p in parts)
    for part in parts[1:]:
        regroups = first.group_index is None and part.group_index is None and \
            all(p.group_size % group_size == 0 for p in parts)
        if part.activation != first.activation or part.group_size != first.group_size and not regroups:
            raise ValueError("the packed projections of one layer are quantized differently: "
                             f"{(first.bits, first.group_size, first.activation)} and "
                             f"{(part.bits, part.group_size, part.activation)}")
        if (part.group_index is None) != (first.group_index is None) or (
                part.group_index is not None and not torch.equal(part.group_index, first.group_index)):
            raise ValueError("the packed projections of one layer have different act-order group indices (g_idx)")
    if first.group_index is None:
        parts = [p.regrouped(group_size) for p in parts]

    def joined(name: str) -> torch.Tensor | None:
        tensors = [getattr(p, name) for p in parts]
        if all(t is None for t in tensors):
            return None
        return torch.cat([torch.zeros_like(p.scales) if t is None else t for p, t in zip(parts, tensors)])

    return replace(parts[0], bits=max(p.bits for p in parts), qweight=torch.cat([p.qweight for p in parts]),
                   scales=joined("scales"), zeros=joined("zeros"), minimums=joined("minimums"))


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
