"""Qwen2.5-VL's vision encoder (transformers' Qwen2_5_VisionTransformerPretrainedModel), sharded over the
tensor-parallel group like the text layers. It turns an image processor's patch rows into the rows the language
model takes in place of the image tokens:

    pixel rows [patches, C*T*P*P]
      -> patch embed (Conv3d, stride = kernel: one matmul per patch)          replicated
      -> reorder into windows (groups of merge x merge patches, window_index)  host-computed
      -> depth x [RMSNorm -> attention (qkv, 2D rotary, SDPA per segment, proj) -> + residual
                  RMSNorm -> gated MLP (gate/up, act, down)                     -> + residual]
             segments: a window's patches, or a whole frame in fullatt_block_indexes' blocks
      -> merger: RMSNorm -> merge x merge patches as one row -> Linear -> GELU -> Linear
      -> back to the image's order (the window order reversed)          -> [patches / merge^2, out_hidden]

Sharded: the attention heads (qkv column-parallel, its checkpoint's fused q|k|v split per rank; proj
row-parallel), the MLP (gate/up column-parallel, down row-parallel) and the merger (mlp.0 column-parallel,
mlp.2 row-parallel); each row-parallel layer all-reduces its partial sums and adds its bias once. The patch embed
and the norms are replicated. Every rank ends with the whole output.

The checkpoint's vision tensors (`model.visual.*` in transformers 5, `visual.*` before) load by the names
checkpoint_target gives them; load_vision_weights loads a dict of them through each parameter's weight_loader.
"""
from dataclasses import dataclass, fields
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tpengine.distributed.parallel_state import get_tp_group
from tpengine.layers.activation import GeluTanhAndMul, SiluAndMul
from tpengine.layers.layernorm import RMSNorm
from tpengine.layers.linear import (FUSED, ColumnParallelLinear, QKVParallelLinear, ReplicatedLinear,
                                    RowParallelLinear)
from tpengine.layers.load_state import load_state
from tpengine.models.decoder import GatedMLP


class GeluAndMul(nn.Module):
    """gelu(gate) * up (exact GELU), gate and up packed in the last dimension."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, -1)
        return F.gelu(gate).mul_(up)


# hidden_act -> the gated MLP's act(gate) * up, as transformers' ACT2FN computes act
ACTIVATIONS = {"silu": SiluAndMul, "gelu": GeluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul}
# where the vision tower's tensors sit in a whole Qwen2.5-VL checkpoint: transformers 5's, then older ones'
CHECKPOINT_PREFIXES = ("model.visual.", "visual.")
TOP_MODULES = ("patch_embed.", "blocks.", "merger.")


class VisionSettings:
    """What Qwen's vision configs share: reading a vision_config dict, the checks every tower needs, the sizes
    derived from them. A subclass is a frozen dataclass of its tower's fields; POSITIVE names its integer sizes."""
    POSITIVE: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_dict(cls, d: dict):
        """From an HF vision_config dict (in_chans, num_attention_heads, num_hidden_layers read as aliases); a
        missing key takes transformers' default."""
        d = dict(d)
        for alias, name in (("in_chans", "in_channels"), ("num_attention_heads", "num_heads"),
                            ("num_hidden_layers", "depth")):
            if alias in d and name not in d:
                d[name] = d[alias]
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if "rope_theta" not in d and "rope_theta" in rope:
            d["rope_theta"] = rope["rope_theta"]
        if rope.get("rope_type", rope.get("type", "axial")) not in ("axial", "default"):
            raise ValueError(f"vision_config rope_parameters: rope_type {rope.get('rope_type')!r} is not supported "
                             f"(only axial)")
        values = {f.name: d[f.name] for f in fields(cls) if f.name in d and d[f.name] is not None}
        return cls(**{name: tuple(v) if isinstance(v, list) else v for name, v in values.items()})  # JSON lists

    def check_common(self, activations: dict) -> None:
        """ValueError naming a size that is not a positive integer, heads that do not divide the width or leave
        the 2D rotary an odd split, or an activation the tower does not run."""
        for name in self.POSITIVE:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"vision_config {name}={value!r}: must be a positive integer")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision_config hidden_size={self.hidden_size} is not divisible by "
                             f"num_heads={self.num_heads}")
        if self.head_dim % 4:  # the axial rotary splits each head in h and w halves, each rotated in pairs
            raise ValueError(f"vision_config hidden_size / num_heads = {self.head_dim}: the 2D rotary needs a "
                             f"multiple of 4")
        if self.hidden_act not in activations:
            raise ValueError(f"vision_config hidden_act={self.hidden_act!r} is not supported "
                             f"(supported: {sorted(activations)})")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_features(self) -> int:
        """One patch row's values: C * T * P * P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        """Patches merged into one output row."""
        return self.spatial_merge_size ** 2


@dataclass(frozen=True)
class Qwen2_5_VLVisionSettings(VisionSettings):
    """The vision_config values the encoder runs by; a missing key takes transformers' default."""
    POSITIVE: ClassVar[tuple[str, ...]] = ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels",
                                           "patch_size", "spatial_merge_size", "temporal_patch_size", "window_size",
                                           "out_hidden_size")
    depth: int = 32
    hidden_size: int = 3584
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    out_hidden_size: int = 3584
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6  # transformers' norms always use 1e-6; a config's rms_norm_eps is read if set
    rope_theta: float = 10000.0

    def __post_init__(self):
        self.check_common(ACTIVATIONS)
        if self.merger_window < 1:
            raise ValueError(f"vision_config window_size={self.window_size} is smaller than one merged patch "
                             f"(spatial_merge_size * patch_size = {self.spatial_merge_size * self.patch_size})")
        if any(not 0 <= i < self.depth for i in self.fullatt_block_indexes):
            raise ValueError(f"vision_config fullatt_block_indexes={list(self.fullatt_block_indexes)}: "
                             f"each must be a block index below depth={self.depth}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"vision_config rms_norm_eps={self.rms_norm_eps!r}: must be positive")

    @property
    def merger_window(self) -> int:
        """A window's side, in merged patches."""
        return self.window_size // self.spatial_merge_size // self.patch_size


# --- what the host computes for one call: window order, rotary angles, attention segments ---------------------

@dataclass
class VisionPlan:
    order: torch.Tensor    # merged-patch groups in window order (transformers' window_index)
    reverse: torch.Tensor  # back to the image's order
    cos: torch.Tensor      # [patches, head_dim] float32, in window order
    sin: torch.Tensor
    windows: list[torch.Tensor]  # row indices [segments, length] of the windows, one tensor per length
    frames: list[torch.Tensor]   # the same of whole frames (the full-attention blocks)


def window_order(grid_thw: list[tuple[int, int, int]], merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """The merged-patch groups of every image in window order, and the windows' patch counts; windows tile each
    frame row-major, window rows and columns cut short at the frame's edge (transformers' get_vision_window_index)."""
    order, lengths, offset = [], [], 0
    for t, h, w in grid_thw:
        gh, gw = h // merge, w // merge
        index = torch.arange(t * gh * gw).reshape(t, gh, gw)
        pad_h, pad_w = -gh % window, -gw % window
        padded = F.pad(index, (0, pad_w, 0, pad_h), value=-1)
        nh, nw = (gh + pad_h) // window, (gw + pad_w) // window
        padded = padded.reshape(t, nh, window, nw, window).permute(0, 1, 3, 2, 4).reshape(t * nh * nw, -1)
        kept = padded >= 0
        order.append(padded[kept] + offset)
        lengths.extend((kept.sum(1) * merge * merge).tolist())
        offset += t * gh * gw
    return torch.cat(order), [n for n in lengths if n > 0]


def patch_positions(grid_thw: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """[patches, 2] each patch's (row, column) in its frame, in the processor's order: merge x merge blocks
    row-major, the patches within a block row-major, frame after frame."""
    positions = []
    for t, h, w in grid_thw:
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        block = (h // merge, merge, w // merge, merge)
        pos = torch.stack([rows.reshape(block).transpose(1, 2).flatten(),
                           cols.reshape(block).transpose(1, 2).flatten()], dim=-1)
        positions.append(pos.repeat(t, 1))
    return torch.cat(positions)


def rotary_angles(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [patches, head_dim] of the axial rotary: a quarter of the frequencies turn with the row, a
    quarter with the column, repeated for the rotated half (transformers' Qwen2_5_VLVisionRotaryEmbedding)."""
    spatial_dim = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, spatial_dim, 2, dtype=torch.float) / spatial_dim))
    freqs = positions[..., None].float() * inv_freq  # [patches, 2, head_dim / 4]
    freqs = freqs.flatten(1)  # row's, then column's
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos(), angles.sin()


def segment_rows(lengths: list[int], device: torch.device) -> list[torch.Tensor]:
    """Consecutive segments of these lengths as row indices [segments, length], one tensor per distinct length:
    the segments of a length attend in one batched SDPA."""
    lengths_t = torch.tensor(lengths)
    starts = torch.cumsum(lengths_t, 0) - lengths_t
    return [(starts[lengths_t == n][:, None] + torch.arange(n)).to(device) for n in sorted(set(lengths))]


def plan_for(settings: Qwen2_5_VLVisionSettings, grid_thw: list[tuple[int, int, int]],
             device: torch.device) -> VisionPlan:
    merge = settings.spatial_merge_size
    order, window_lengths = window_order(grid_thw, merge, settings.merger_window)
    cos, sin = rotary_angles(patch_positions(grid_thw, merge), settings.head_dim, settings.rope_theta)
    in_windows = (order[:, None] * settings.merge_unit + torch.arange(settings.merge_unit)).flatten()
    frame_lengths = [h * w for t, h, w in grid_thw for _ in range(t)]
    return VisionPlan(order.to(device), torch.argsort(order).to(device), cos[in_windows].to(device),
                      sin[in_windows].to(device), segment_rows(window_lengths, device),
                      segment_rows(frame_lengths, device))


def check_inputs(settings: Qwen2_5_VLVisionSettings, pixel_values: torch.Tensor, grid_thw) -> list[tuple]:
    grid = [tuple(int(v) for v in thw) for thw in (grid_thw.tolist() if torch.is_tensor(grid_thw) else grid_thw)]
    merge = settings.spatial_merge_size
    if not grid:
        raise ValueError("grid_thw is empty: the encoder takes one (t, h, w) per image or video")
    for t, h, w in grid:
        if t <= 0 or h <= 0 or w <= 0 or h % merge or w % merge:
            raise ValueError(f"grid_thw ({t}, {h}, {w}): each side must be positive, h and w multiples of "
                             f"spatial_merge_size={merge}")
    rows = sum(t * h * w for t, h, w in grid)
    if tuple(pixel_values.shape) != (rows, settings.patch_features):
        raise ValueError(f"pixel_values has shape {list(pixel_values.shape)}, grid_thw {grid} needs "
                         f"[{rows}, {settings.patch_features}]")
    return grid


# --- the layers ----------------------------------------------------------------------------------------------

def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: list[torch.Tensor],
                      scale: float) -> torch.Tensor:
    """Non-causal attention of q, k, v [rows, heads, head_dim] within each segment (row indices [n, length])."""
    out = torch.empty_like(q)
    for rows in segments:
        # [n, length, heads, head_dim] -> [n, heads, length, head_dim]: the segments as SDPA's batch
        qs, ks, vs = (x[rows].transpose(1, 2) for x in (q, k, v))
        out[rows] = F.scaled_dot_product_attention(qs, ks, vs, scale=scale).transpose(1, 2)
    return out


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [rows, heads, head_dim] rotated in float32 (neox halves), back in x's dtype, as transformers does."""
    x32 = x.float()
    half = x32.size(-1) // 2
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class VisionAttention(nn.Module):
    """This rank's heads: q, k, v of them (the fused checkpoint qkv split by heads), attention within each
    segment, then proj's share of the output, all-reduced."""

    def __init__(self, settings: Qwen2_5_VLVisionSettings):
        super().__init__()
        self.head_dim = settings.head_dim
        self.qkv = QKVParallelLinear(settings.hidden_size, self.head_dim, settings.num_heads, settings.num_heads,
                                     bias=True)
        self.num_heads = self.qkv.num_heads  # this rank's
        self.proj = RowParallelLinear(settings.hidden_size, settings.hidden_size, bias=True)
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segments: list[torch.Tensor]) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.size(0), 3, self.num_heads, self.head_dim).unbind(1)
        out = segment_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, segments, self.scale)
        return self.proj(out.flatten(1))


class VisionBlock(nn.Module):
    def __init__(self, settings: Qwen2_5_VLVisionSettings):
        super().__init__()
        self.norm1 = RMSNorm(settings.hidden_size, eps=settings.rms_norm_eps)
        self.norm2 = RMSNorm(settings.hidden_size, eps=settings.rms_norm_eps)
        self.attn = VisionAttention(settings)
        self.mlp = GatedMLP(settings.hidden_size, settings.intermediate_size, bias=True,
                            activation=ACTIVATIONS[settings.hidden_act])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segments: list[torch.Tensor]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchEmbedLinear(ReplicatedLinear):
    """The patch embed's Conv3d (Gemma 3's Conv2d) as a matmul: its stride is its kernel, so each output is one
    patch row (C, T, P, P flattened, the processor's order) times the kernel flattened alike. Loads the checkpoint's
    [embed, C, T, P, P] (or [embed, C, P, P]) kernel as [embed, C*T*P*P]."""

    def weight_loader(self, param: nn.Parameter, loaded_weight) -> None:
        if isinstance(loaded_weight, torch.Tensor) and loaded_weight.dim() > 2:
            loaded_weight = loaded_weight.reshape(loaded_weight.size(0), -1)
        super().weight_loader(param, loaded_weight)


class PatchEmbed(nn.Module):
    def __init__(self, settings: Qwen2_5_VLVisionSettings):
        super().__init__()
        self.proj = PatchEmbedLinear(settings.patch_features, settings.hidden_size, bias=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.proj(pixel_values)


class PatchMerger(nn.Module):
    """RMSNorm, then each merge x merge patches (consecutive rows) as one row through Linear -> GELU -> Linear:
    mlp.0 column-parallel, mlp.2 row-parallel (all-reduced)."""

    def __init__(self, settings: Qwen2_5_VLVisionSettings):
        super().__init__()
        self.merged_size = settings.hidden_size * settings.merge_unit
        self.ln_q = RMSNorm(settings.hidden_size, eps=settings.rms_norm_eps)
        self.mlp = nn.Sequential(ColumnParallelLinear(self.merged_size, self.merged_size, bias=True), nn.GELU(),
                                 RowParallelLinear(self.merged_size, settings.out_hidden_size, bias=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged_size))


def check_shardable(settings: Qwen2_5_VLVisionSettings, tp_size: int) -> None:
    """ValueError naming the vision_config value the tensor-parallel size does not divide."""
    for name, value in (("num_heads", settings.num_heads), ("intermediate_size", settings.intermediate_size),
                        ("hidden_size * spatial_merge_size^2", settings.hidden_size * settings.merge_unit)):
        if value % tp_size:
            raise ValueError(f"vision_config {name}={value} is not divisible by the tensor-parallel size {tp_size}")


class Qwen2_5_VisionTransformer(nn.Module):
    # checkpoint module -> (our module, weight_loader shard id): q|k|v stay fused in the checkpoint and split per
    # rank by QKVParallelLinear; gate and up load into the two halves of gate_up_proj
    packed_modules_mapping = {"qkv": ("qkv", FUSED), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, settings: Qwen2_5_VLVisionSettings):
        super().__init__()
        check_shardable(settings, get_tp_group().size)
        self.settings = settings
        self.fullatt_blocks = frozenset(settings.fullatt_block_indexes)
        self.patch_embed = PatchEmbed(settings)
        self.blocks = nn.ModuleList([VisionBlock(settings) for _ in range(settings.depth)])
        self.merger = PatchMerger(settings)

    def forward(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """[patches / merge^2, out_hidden_size] in the module's dtype, each image's rows in grid_thw's order."""
        grid = check_inputs(self.settings, pixel_values, grid_thw)
        norm_weight = self.merger.ln_q.weight
        plan = plan_for(self.settings, grid, norm_weight.device)
        x = self.patch_embed(pixel_values.to(norm_weight.device, norm_weight.dtype))
        unit, hidden = self.settings.merge_unit, self.settings.hidden_size
        x = x.view(-1, unit, hidden)[plan.order].view(-1, hidden)  # merged groups in window order
        for i, block in enumerate(self.blocks):
            x = block(x, plan.cos, plan.sin, plan.frames if i in self.fullatt_blocks else plan.windows)
        return self.merger(x)[plan.reverse]

    def checkpoint_target(self, name: str) -> tuple[str | None, tuple]:
        return tower_checkpoint_target(name, TOP_MODULES, self.packed_modules_mapping)


def tower_checkpoint_target(name: str, top_modules: tuple[str, ...], packed: dict) -> tuple[str | None, tuple]:
    """A vision tower's parameter for a checkpoint tensor (named relative to the tower, or with its `model.visual.`
    / `visual.` prefix) and the extra arguments its weight_loader takes; None for a tensor not the tower's (the
    language model's, or a rotary buffer, which is computed). packed: checkpoint name -> (ours, shard id)."""
    for prefix in CHECKPOINT_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    if not name.startswith(top_modules):
        return None, ()
    for checkpoint_name, (ours, shard_id) in packed.items():
        if f".{checkpoint_name}." in name:
            return name.replace(f".{checkpoint_name}.", f".{ours}."), (shard_id,)
    return name, ()


def _filled(param: nn.Parameter, loaded_args: set) -> bool:
    return (FUSED,) in loaded_args or all(args in loaded_args for args in load_state(param).shards)


def load_vision_weights(module: Qwen2_5_VisionTransformer, tensors: dict[str, torch.Tensor]) -> None:
    """The vision tower's checkpoint tensors (relative or prefixed names) into module, each through its
    parameter's weight_loader (this rank's shard); others are skipped. ValueError naming a tensor with no
    parameter, one that does not fit, or a parameter no tensor filled."""
    params = dict(module.named_parameters())
    loaded: dict[str, set] = {}
    for name, tensor in tensors.items():
        target, args = module.checkpoint_target(name)
        if target is None:
            continue
        if target not in params:
            raise ValueError(f"vision checkpoint tensor {name!r} has no matching parameter ({target})")
        param = params[target]
        try:
            load_state(param).weight_loader(param, tensor, *args)
        except (ValueError, RuntimeError, IndexError) as e:
            raise ValueError(f"vision checkpoint tensor {name!r} cannot be loaded: {e}") from None
        loaded.setdefault(target, set()).add(args)
    missing = [n for n, p in params.items() if not _filled(p, loaded.get(n, set()))]
    if missing:
        raise ValueError(f"the vision checkpoint lacks {missing}")
