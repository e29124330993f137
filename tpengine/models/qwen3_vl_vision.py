"""Qwen3-VL's vision encoder (transformers' Qwen3VLVisionModel), sharded over the tensor-parallel group like the
text layers. It turns an image processor's patch rows into the rows the language model takes in place of the image
tokens, and the deepstack features the first text layers add to those rows:

    pixel rows [patches, C*T*P*P]
      -> patch embed (Conv3d with bias, stride = kernel: one matmul per patch)            replicated
      -> + pos_embed: the learned square grid bilinearly resampled onto each frame's grid  replicated
      -> depth x [LayerNorm -> attention (qkv, 2D rotary, SDPA per frame, proj)  -> + residual
                  LayerNorm -> MLP (linear_fc1, act, linear_fc2)                 -> + residual]
             |  after each block in deepstack_visual_indexes:
             +--> its deepstack merger: merge x merge patches as one row -> LayerNorm -> fc1 -> GELU -> fc2
      -> merger: LayerNorm -> merge x merge patches as one row -> fc1 -> GELU -> fc2
      => ([patches / merge^2, out_hidden], [[patches / merge^2, out_hidden] per deepstack index])

Unlike Qwen2.5-VL's tower there are no windows (every block attends within a whole frame, transformers'
cu_seqlens) and so no reordering; the MLP is plain, the norms LayerNorms. The 2D rotary, the per-segment SDPA, the
attention module and the loader are Qwen2.5-VL's (qwen2_5_vl_vision.py).

Sharded: the attention heads (qkv column-parallel, its checkpoint's fused q|k|v split per rank; proj
row-parallel), the MLP (linear_fc1 column-parallel, linear_fc2 row-parallel) and every merger (linear_fc1
column-parallel, linear_fc2 row-parallel); each row-parallel layer all-reduces its partial sums and adds its bias
once. The patch embed, pos_embed and the norms are replicated. Every rank ends with the whole outputs.

The checkpoint's vision tensors (`model.visual.*`, or `visual.*`) load by the names checkpoint_target gives them;
load_vision_weights loads a dict of them through each parameter's weight_loader.
"""
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from tpengine.distributed.parallel_state import get_tp_group
from tpengine.layers.linear import FUSED, ColumnParallelLinear, RowParallelLinear
from tpengine.models.qwen2_5_vl_vision import (PatchEmbedLinear, VisionAttention, VisionSettings,
                                               check_inputs, check_shardable, load_vision_weights, patch_positions,
                                               rotary_angles, segment_rows, tower_checkpoint_target)

__all__ = ["Qwen3VLVisionSettings", "Qwen3VLVisionTransformer", "load_vision_weights", "position_interpolation"]

# hidden_act -> the block MLP's activation, as transformers' ACT2FN computes it
ACTIVATIONS = {"gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"), "gelu": nn.GELU, "silu": nn.SiLU}
TOP_MODULES = ("patch_embed.", "pos_embed.", "blocks.", "merger.", "deepstack_merger_list.")
NORM_EPS = 1e-6  # transformers' vision LayerNorms are built with eps 1e-6, whatever the config says


@dataclass(frozen=True)
class Qwen3VLVisionSettings(VisionSettings):
    """The vision_config values the encoder runs by; a missing key takes transformers' default."""
    POSITIVE: ClassVar[tuple[str, ...]] = ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels",
                                           "patch_size", "spatial_merge_size", "temporal_patch_size",
                                           "out_hidden_size", "num_position_embeddings")
    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    rope_theta: float = 10000.0

    def __post_init__(self):
        self.check_common(ACTIVATIONS)
        if isinstance(self.deepstack_visual_indexes, list):  # as a JSON config writes it
            object.__setattr__(self, "deepstack_visual_indexes", tuple(self.deepstack_visual_indexes))
        indexes = self.deepstack_visual_indexes
        # transformers finds a block's merger by indexes.index(block): a repeated index would leave a merger unused
        if (not isinstance(indexes, tuple) or any(not isinstance(i, int) or not 0 <= i < self.depth for i in indexes)
                or len(set(indexes)) != len(indexes)):
            raise ValueError(f"vision_config deepstack_visual_indexes={indexes!r}: each must be a distinct block "
                             f"index below depth={self.depth}")
        if not self.rope_theta > 0:
            raise ValueError(f"vision_config rope_theta={self.rope_theta!r}: must be positive")

    @property
    def grid_side(self) -> int:
        """The learned position grid's side: transformers uses the first side^2 of num_position_embeddings."""
        return math.isqrt(self.num_position_embeddings)


# --- what the host computes for one call: position taps, rotary angles, attention segments -------------------

def axis_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear taps [n, 2] into a side-long axis of the learned grid, and their weights, for positions index on an
    axis of size positions (align_corners: the ends map onto the grid's ends). The same float32 ops, in the same
    order, as transformers' _interpolation_axis_taps_weights, so the weights are bit for bit its."""
    src = index.to(torch.float32) * (side - 1) / torch.clamp(size - 1, min=1)
    floor = torch.floor(src)
    offsets = torch.arange(0, 2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def position_interpolation(grid_thw: list[tuple[int, int, int]], merge: int,
                           side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """pos_embed rows [patches, 4] (the 2 x 2 nearest grid points) and their bilinear weights [patches, 4] float32,
    each patch in the processor's order (merge x merge blocks), every frame of a video alike."""
    positions = patch_positions(grid_thw, merge)  # [patches, 2] (row, column)
    heights = torch.cat([torch.full((t * h * w,), h) for t, h, w in grid_thw])
    widths = torch.cat([torch.full((t * h * w,), w) for t, h, w in grid_thw])
    h_taps, h_weights = axis_taps(positions[:, 0], heights, side)
    w_taps, w_weights = axis_taps(positions[:, 1], widths, side)
    indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
    return indices, weights


@dataclass
class VisionPlan:
    pos_indices: torch.Tensor  # [patches, 4] pos_embed rows
    pos_weights: torch.Tensor  # [patches, 4] float32
    cos: torch.Tensor          # [patches, head_dim] float32
    sin: torch.Tensor
    frames: list[torch.Tensor]  # row indices [segments, length] of whole frames, one tensor per length


def plan_for(settings: Qwen3VLVisionSettings, grid_thw: list[tuple[int, int, int]],
             device: torch.device) -> VisionPlan:
    merge = settings.spatial_merge_size
    indices, weights = position_interpolation(grid_thw, merge, settings.grid_side)
    cos, sin = rotary_angles(patch_positions(grid_thw, merge), settings.head_dim, settings.rope_theta)
    frame_lengths = [h * w for t, h, w in grid_thw for _ in range(t)]  # each frame attends within itself
    return VisionPlan(indices.to(device), weights.to(device), cos.to(device), sin.to(device),
                      segment_rows(frame_lengths, device))


# --- the layers ----------------------------------------------------------------------------------------------

class VisionMLP(nn.Module):
    """linear_fc1 (column-parallel) -> act -> linear_fc2 (row-parallel, all-reduced): not gated."""

    def __init__(self, settings: Qwen3VLVisionSettings):
        super().__init__()
        self.linear_fc1 = ColumnParallelLinear(settings.hidden_size, settings.intermediate_size, bias=True)
        self.act = ACTIVATIONS[settings.hidden_act]()
        self.linear_fc2 = RowParallelLinear(settings.intermediate_size, settings.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, settings: Qwen3VLVisionSettings):
        super().__init__()
        self.norm1 = nn.LayerNorm(settings.hidden_size, eps=NORM_EPS)
        self.norm2 = nn.LayerNorm(settings.hidden_size, eps=NORM_EPS)
        self.attn = VisionAttention(settings)  # Qwen2.5-VL's: the same fused qkv, rotary and scale
        self.mlp = VisionMLP(settings)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segments: list[torch.Tensor]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, settings: Qwen3VLVisionSettings):
        super().__init__()
        self.proj = PatchEmbedLinear(settings.patch_features, settings.hidden_size, bias=True)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.proj(pixel_values)


class PatchMerger(nn.Module):
    """Each merge x merge patches (consecutive rows) as one row through LayerNorm -> linear_fc1 -> GELU ->
    linear_fc2 (fc1 column-parallel, fc2 row-parallel). The final merger norms each patch before the merge
    (use_postshuffle_norm False), a deepstack merger the merged row (True), as transformers'."""

    def __init__(self, settings: Qwen3VLVisionSettings, use_postshuffle_norm: bool):
        super().__init__()
        self.merged_size = settings.hidden_size * settings.merge_unit
        self.use_postshuffle_norm = use_postshuffle_norm
        self.norm = nn.LayerNorm(self.merged_size if use_postshuffle_norm else settings.hidden_size, eps=NORM_EPS)
        self.linear_fc1 = ColumnParallelLinear(self.merged_size, self.merged_size, bias=True)
        self.act = nn.GELU()
        self.linear_fc2 = RowParallelLinear(self.merged_size, settings.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_postshuffle_norm:
            x = self.norm(x.view(-1, self.merged_size))
        else:
            x = self.norm(x).view(-1, self.merged_size)
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3VLVisionTransformer(nn.Module):
    # checkpoint module -> (our module, weight_loader shard id): q|k|v stay fused in the checkpoint and split per
    # rank by QKVParallelLinear; every other name is ours as it is
    packed_modules_mapping = {"qkv": ("qkv", FUSED)}

    def __init__(self, settings: Qwen3VLVisionSettings):
        super().__init__()
        check_shardable(settings, get_tp_group().size)
        self.settings = settings
        self.patch_embed = PatchEmbed(settings)
        self.pos_embed = nn.Embedding(settings.num_position_embeddings, settings.hidden_size)
        self.pos_embed.weight.requires_grad_(False)
        self.blocks = nn.ModuleList([VisionBlock(settings) for _ in range(settings.depth)])
        self.merger = PatchMerger(settings, use_postshuffle_norm=False)
        self.deepstack_merger_list = nn.ModuleList([PatchMerger(settings, use_postshuffle_norm=True)
                                                    for _ in settings.deepstack_visual_indexes])
        # block -> its deepstack merger (the i-th index's is the i-th merger, as transformers pairs them)
        self.deepstack_after = {block: i for i, block in enumerate(settings.deepstack_visual_indexes)}

    def forward(self, pixel_values: torch.Tensor,
                grid_thw: list[tuple[int, int, int]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """transformers' (pooler_output, deepstack_features): the merged rows [patches / merge^2, out_hidden_size]
        and one such tensor per deepstack index, in block order; in the module's dtype, each image's rows in
        grid_thw's order."""
        grid = check_inputs(self.settings, pixel_values, grid_thw)
        table = self.pos_embed.weight
        plan = plan_for(self.settings, grid, table.device)
        x = self.patch_embed(pixel_values.to(table.device, table.dtype))
        # the 4 weighted grid rows summed in float32 (the weights' dtype), then cast, as transformers does
        x = x + (table[plan.pos_indices] * plan.pos_weights[:, :, None]).sum(1).to(x.dtype)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, plan.cos, plan.sin, plan.frames)
            if i in self.deepstack_after:
                deepstack.append(self.deepstack_merger_list[self.deepstack_after[i]](x))
        return self.merger(x), deepstack

    def checkpoint_target(self, name: str) -> tuple[str | None, tuple]:
        return tower_checkpoint_target(name, TOP_MODULES, self.packed_modules_mapping)
