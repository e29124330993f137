"""An FP8 (e4m3) linear kept as FP8, for a platform with FP8 matmuls (CUDA sm_89+), and the activation
quantization its matmul needs.

The value an Fp8Weight stands for: w[o, i] = weight[o, i] * scale(o, i), the scale one per tensor, one per
output channel, or one per block of block_size = (rows, columns) (DeepSeek-V3's and Qwen3's 128x128, a
compressed-tensors "block" strategy's block_structure). Its input is quantized to e4m3 as it arrives: with
the checkpoint's static input_scale where it has one, else dynamically per token, or per group of
block columns of a token for a block-scaled weight (DeepSeek-V3's 1x128 activation groups).
The layer shards it with `rows` and `columns` as it shards a QuantizedWeight and joins q/k/v and gate/up
with `cat_fp8_rows`; the CPU never keeps one (it reads FP8 into float weights at load).
"""
from dataclasses import dataclass, replace

import torch

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


@dataclass(frozen=True)
class Fp8Weight:
    weight: torch.Tensor  # float8_e4m3fn [out, in]
    scales: torch.Tensor  # float32 [1, 1] (tensor), [out, 1] (channel) or [ceil(out/rows), ceil(in/columns)]
    block_size: tuple[int, int] | None = None  # (rows, columns) of each block scale; None: tensor or channel
    input_scale: torch.Tensor | None = None  # float32 [1, 1]: static activation scale; None: dynamic

    def __post_init__(self):
        out_features, in_features = self.weight.shape
        assert self.weight.dtype == torch.float8_e4m3fn and self.scales.dtype == torch.float32
        if self.block_size is None:
            assert self.scales.shape in ((1, 1), (out_features, 1))
        else:
            rows, columns = self.block_size
            assert self.scales.shape == (-(-out_features // rows), -(-in_features // columns))
        assert self.input_scale is None or self.input_scale.shape == (1, 1)

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def to(self, device: torch.device) -> "Fp8Weight":
        return replace(self, weight=self.weight.to(device), scales=self.scales.to(device),
                       input_scale=None if self.input_scale is None else self.input_scale.to(device))

    def expanded_scales(self) -> torch.Tensor:
        """float32 scales broadcastable to [out, in]: [1, 1], [out, 1], or each block's repeated over it."""
        if self.block_size is None:
            return self.scales
        out_features, in_features = self.weight.shape
        rows, columns = self.block_size
        return self.scales.repeat_interleave(rows, 0)[:out_features].repeat_interleave(columns, 1)[:, :in_features]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float [out, in] weight, computed in float32 (what the CPU loads an FP8 checkpoint as)."""
        return (self.weight.float() * self.expanded_scales()).to(dtype)

    def rows(self, start: int, length: int) -> "Fp8Weight":
        """Output features start..start+length (a column-parallel shard, or one part of q/k/v, gate/up)."""
        weight = self.weight.narrow(0, start, length)
        if self.block_size is None:
            scales = self.scales if self.scales.size(0) == 1 else self.scales.narrow(0, start, length)
            return replace(self, weight=weight, scales=scales)
        rows = self.block_size[0]
        _check_whole_blocks(start, length, self.weight.size(0), rows, "output features", "rows")
        return replace(self, weight=weight, scales=self.scales.narrow(0, start // rows, -(-length // rows)))

    def columns(self, start: int, length: int, num_shards: int) -> "Fp8Weight":
        """Input features start..start+length, one of num_shards (a row-parallel shard); a block-scaled weight's
        shard must hold whole blocks: a ValueError names the shard's columns and the block's."""
        weight = self.weight.narrow(1, start, length)
        if self.block_size is None:
            return replace(self, weight=weight)
        columns = self.block_size[1]
        _check_whole_blocks(start, length, self.weight.size(1), columns, "input features", "columns",
                            num_shards)
        return replace(self, weight=weight,
                       scales=self.scales.narrow(1, start // columns, -(-length // columns)))


def _check_whole_blocks(start: int, length: int, total: int, block: int, what: str, block_what: str,
                        num_shards: int | None = None) -> None:
    # a shard may end in the weight's own last, partial block, never cut one
    if start % block or (length % block and start + length != total):
        who = f"tensor parallel size {num_shards}" if num_shards else "this shard"
        raise ValueError(f"{who} splits an FP8 weight block: a rank takes {length} {what} from {start}, not a "
                         f"multiple of the block's {block} {block_what}")


def cat_fp8_rows(parts: list[Fp8Weight]) -> Fp8Weight:
    """Packed projections (q/k/v, gate/up) as one weight, each part keeping its own scales: per-tensor scales
    become one per output channel; a static input scale becomes the parts' largest (the input is shared, and a
    larger scale only costs precision where a smaller one would clip)."""
    first = parts[0]
    if any(part.block_size != first.block_size or (part.input_scale is None) != (first.input_scale is None)
           for part in parts):
        raise ValueError("the packed projections of one layer are FP8-quantized differently: "
                         f"{[(p.block_size, p.input_scale is not None) for p in parts]}")
    input_scale = None if first.input_scale is None else torch.stack([p.input_scale for p in parts]).amax(0)
    if first.block_size is not None:
        rows = first.block_size[0]
        for part in parts[:-1]:
            if part.weight.size(0) % rows:
                raise ValueError(f"a packed projection of {part.weight.size(0)} output features is not whole FP8 "
                                 f"blocks of {rows} rows: its block scales cannot be joined with the next part's")
        scales = torch.cat([p.scales for p in parts])
    else:
        scales = torch.cat([p.scales.expand(p.weight.size(0), 1) for p in parts])
    return replace(first, weight=torch.cat([p.weight for p in parts]), scales=scales, input_scale=input_scale)


def quantize_fp8_weight(weight: torch.Tensor) -> Fp8Weight:
    """A float [out, in] weight as e4m3 with one scale per output channel, absmax / 448 (online
    quantization="fp8"), its inputs quantized dynamically per token."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"FP8 quantization takes a float [out, in] weight, not {weight.dtype} {list(weight.shape)}")
    weight = weight.float()
    scales = weight.abs().amax(dim=1, keepdim=True) / E4M3_MAX
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero row: 0 / 1, not 0 / 0
    return Fp8Weight(weight=(weight / scales).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scales=scales)


def quantize_fp8_activation(x: torch.Tensor, group_size: int | None = None,
                            input_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values [tokens, in], float32 scales [tokens, groups]) of a [tokens, in] input: each token's (or
    each group_size columns of it) largest magnitude over 448, an all-zero group getting scale 1; with a static
    input_scale, that one scale everywhere. Values are x / scale, clamped to +-448, rounded to nearest even."""
    tokens, in_features = x.shape
    group_size = group_size or in_features
    num_groups = -(-in_features // group_size)
    x = x.float()
    if input_scale is not None:
        scales = input_scale.float().reshape(1, 1).expand(tokens, num_groups)
    else:
        padded = torch.nn.functional.pad(x, (0, num_groups * group_size - in_features))
        scales = padded.view(tokens, num_groups, group_size).abs().amax(dim=2) / E4M3_MAX
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    per_column = scales.repeat_interleave(group_size, 1)[:, :in_features] if num_groups > 1 else scales
    values = (x / per_column).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return values, scales.contiguous()
