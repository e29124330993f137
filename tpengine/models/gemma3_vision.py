"""Gemma 3's vision tower (transformers' SiglipVisionModel, no pooling head read) and its multimodal projector
(Gemma3MultiModalProjector), sharded over the tensor-parallel group like the text layers. It turns whole images
into the rows the language model takes in place of the image tokens (transformers' get_image_features):

    pixel_values [images, C, S, S]
      -> patch embedding (Conv2d with bias, stride = kernel: one matmul per patch)   replicated
      -> + position embedding (one learned row per patch, no interpolation)           replicated
      -> layers x [LayerNorm -> attention (qkv, SDPA over each image's patches, out_proj) -> + residual
                   LayerNorm -> MLP (fc1, act, fc2)                                       -> + residual]
      -> post_layernorm                                                               replicated
      -> projector: each image's patch grid average-pooled to tokens_per_side^2 rows
                    -> Gemma RMSNorm (x * (1 + w), float32) -> @ mm_input_projection_weight  replicated
      => [images * mm_tokens_per_image, text_hidden]

Attention is full and bidirectional within an image, never across images: the images are SDPA's batch.

Sharded: the attention heads (q, k and v in one column-parallel qkv_proj, each rank its heads; out_proj
row-parallel) and the MLP (fc1 column-parallel, fc2 row-parallel); each row-parallel layer all-reduces its partial
sums and adds its bias once. The embeddings, the norms and the projector are replicated. Every rank ends with the
whole output.

The checkpoint's tensors load by the names checkpoint_target gives them: `vision_tower.` (transformers 5's, and
with `vision_model.` after it, the released checkpoints') and `multi_modal_projector.`, each with or without a
leading `model.`. The pooling head (`vision_tower.head.`, built when vision_use_head) is skipped: the image
features never read it. load_vision_weights (qwen2_5_vl_vision.py) loads a dict of them.
"""
import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from tpengine.distributed.parallel_state import get_tp_group
from tpengine.layers.layernorm import GemmaRMSNorm
from tpengine.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tpengine.models.qwen2_5_vl_vision import PatchEmbedLinear, load_vision_weights
from tpengine.models.qwen3_vl_vision import ACTIVATIONS

__all__ = ["Gemma3VisionSettings", "Gemma3VisionTower", "load_vision_weights"]

POSITIVE = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels",
            "image_size", "patch_size", "mm_tokens_per_image", "text_hidden_size")
# checkpoint projection -> (our fused module, QKVParallelLinear shard id)
PACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}


@dataclass(frozen=True)
class Gemma3VisionSettings:
    """The vision_config values the tower runs by (a missing key takes transformers 5's SiglipVisionConfig
    default, as a Gemma3Config fills it), and the two the projector takes from the whole config."""
    mm_tokens_per_image: int
    text_hidden_size: int
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 16
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6
    vision_use_head: bool = True  # transformers' default; the head is built but the image features skip it

    @classmethod
    def from_config(cls, vision_config: dict, mm_tokens_per_image: int, text_hidden_size: int):
        present = {f.name: vision_config[f.name] for f in fields(cls)
                   if f.name in vision_config and vision_config[f.name] is not None}
        return cls(**{**present, "mm_tokens_per_image": mm_tokens_per_image, "text_hidden_size": text_hidden_size})

    def __post_init__(self):
        for name in POSITIVE:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{self.where(name)}={value!r}: must be a positive integer")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"vision_config hidden_size={self.hidden_size} is not divisible by "
                             f"num_attention_heads={self.num_attention_heads}")
        if self.image_size % self.patch_size:
            raise ValueError(f"vision_config image_size={self.image_size} is not divisible by "
                             f"patch_size={self.patch_size}")
        self.check_pooling()
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"vision_config hidden_act={self.hidden_act!r} is not supported "
                             f"(supported: {sorted(ACTIVATIONS)})")
        if not isinstance(self.layer_norm_eps, (int, float)) or not self.layer_norm_eps > 0:
            raise ValueError(f"vision_config layer_norm_eps={self.layer_norm_eps!r}: must be positive")

    def check_pooling(self) -> None:
        """The projector pools each side's patches in equal windows: one token side must divide the patch side."""
        side = math.isqrt(self.mm_tokens_per_image)
        if side * side != self.mm_tokens_per_image:
            raise ValueError(f"mm_tokens_per_image={self.mm_tokens_per_image} is not a perfect square")
        if self.patches_per_side % side:
            raise ValueError(f"mm_tokens_per_image={self.mm_tokens_per_image}: its side {side} does not divide the "
                             f"{self.patches_per_side} patches per side (image_size / patch_size)")

    @staticmethod
    def where(name: str) -> str:
        return name if name in ("mm_tokens_per_image", "text_hidden_size") else f"vision_config {name}"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side ** 2

    @property
    def tokens_per_side(self) -> int:
        return math.isqrt(self.mm_tokens_per_image)

    @property
    def pool_kernel(self) -> int:
        """Patches per side averaged into one token (transformers' AvgPool2d kernel and stride)."""
        return self.patches_per_side // self.tokens_per_side


def check_shardable(settings: Gemma3VisionSettings, tp_size: int) -> None:
    """ValueError naming the vision_config value the tensor-parallel size does not divide."""
    for name in ("num_attention_heads", "intermediate_size"):
        value = getattr(settings, name)
        if value % tp_size:
            raise ValueError(f"vision_config {name}={value} is not divisible by the tensor-parallel size {tp_size}")


# --- the tower -----------------------------------------------------------------------------------------------

class VisionEmbeddings(nn.Module):
    def __init__(self, settings: Gemma3VisionSettings):
        super().__init__()
        self.settings = settings
        patch_features = settings.num_channels * settings.patch_size ** 2
        self.patch_embedding = PatchEmbedLinear(patch_features, settings.hidden_size, bias=True)
        self.position_embedding = nn.Embedding(settings.num_patches, settings.hidden_size)
        self.position_embedding.weight.requires_grad_(False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images * patches, hidden]: each image's patches row-major, as the Conv2d's output flattens."""
        images, channels = pixel_values.shape[:2]
        side, patch = self.settings.patches_per_side, self.settings.patch_size
        # [images, C, side, P, side, P] -> [images, row, column, C, P, P]: one patch per row
        patches = pixel_values.view(images, channels, side, patch, side, patch).permute(0, 2, 4, 1, 3, 5)
        x = self.patch_embedding(patches.reshape(images * side * side, -1))
        return (x.view(images, side * side, -1) + self.position_embedding.weight).view(images * side * side, -1)


class VisionAttention(nn.Module):
    """This rank's heads: q, k, v of them (the checkpoint's three projections in one), full attention over each
    image's patches, then out_proj's share of the output, all-reduced."""

    def __init__(self, settings: Gemma3VisionSettings):
        super().__init__()
        self.head_dim = settings.head_dim
        heads = settings.num_attention_heads
        self.qkv_proj = QKVParallelLinear(settings.hidden_size, self.head_dim, heads, heads, bias=True)
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.out_proj = RowParallelLinear(settings.hidden_size, settings.hidden_size, bias=True)
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, images: int) -> torch.Tensor:
        # [images * patches, 3 * heads * head_dim] -> q, k, v [images, heads, patches, head_dim]
        qkv = self.qkv_proj(x).view(images, -1, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], scale=self.scale)
        return self.out_proj(out.transpose(1, 2).reshape(x.size(0), -1))


class VisionMLP(nn.Module):
    """fc1 (column-parallel) -> act -> fc2 (row-parallel, all-reduced): not gated."""

    def __init__(self, settings: Gemma3VisionSettings):
        super().__init__()
        self.fc1 = ColumnParallelLinear(settings.hidden_size, settings.intermediate_size, bias=True)
        self.act = ACTIVATIONS[settings.hidden_act]()
        self.fc2 = RowParallelLinear(settings.intermediate_size, settings.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, settings: Gemma3VisionSettings):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(settings.hidden_size, eps=settings.layer_norm_eps)
        self.self_attn = VisionAttention(settings)
        self.layer_norm2 = nn.LayerNorm(settings.hidden_size, eps=settings.layer_norm_eps)
        self.mlp = VisionMLP(settings)

    def forward(self, x: torch.Tensor, images: int) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), images)
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nn.Module):
    def __init__(self, settings: Gemma3VisionSettings):
        super().__init__()
        self.layers = nn.ModuleList([EncoderLayer(settings) for _ in range(settings.num_hidden_layers)])

    def forward(self, x: torch.Tensor, images: int) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, images)
        return x


class SiglipVisionTower(nn.Module):
    """transformers' SiglipVisionModel up to last_hidden_state: [images * patches, hidden]."""

    def __init__(self, settings: Gemma3VisionSettings):
        super().__init__()
        self.embeddings = VisionEmbeddings(settings)
        self.encoder = Encoder(settings)
        self.post_layernorm = nn.LayerNorm(settings.hidden_size, eps=settings.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.post_layernorm(self.encoder(self.embeddings(pixel_values), pixel_values.size(0)))


# --- the projector -------------------------------------------------------------------------------------------

class MultiModalProjector(nn.Module):
    """Each image's patch grid average-pooled in pool_kernel x pool_kernel windows, each token Gemma-RMSNormed,
    then projected to the text width; replicated (small, and every rank needs the whole output)."""

    def __init__(self, settings: Gemma3VisionSettings):
        super().__init__()
        self.settings = settings
        self.mm_soft_emb_norm = GemmaRMSNorm(settings.hidden_size, eps=settings.layer_norm_eps)
        # the checkpoint's layout, [vision hidden, text hidden]: transformers multiplies x @ weight
        self.mm_input_projection_weight = nn.Parameter(torch.empty(settings.hidden_size, settings.text_hidden_size),
                                                       requires_grad=False)

    def forward(self, x: torch.Tensor, images: int) -> torch.Tensor:
        side, hidden = self.settings.patches_per_side, self.settings.hidden_size
        grid = x.view(images, side, side, hidden).permute(0, 3, 1, 2)  # [images, hidden, rows, columns]
        pooled = F.avg_pool2d(grid, self.settings.pool_kernel)  # AvgPool2d's kernel = stride, as transformers'
        tokens = pooled.flatten(2).transpose(1, 2).reshape(-1, hidden).contiguous()
        return torch.matmul(self.mm_soft_emb_norm(tokens), self.mm_input_projection_weight).to(x.dtype)


class Gemma3VisionTower(nn.Module):
    def __init__(self, settings: Gemma3VisionSettings):
        super().__init__()
        check_shardable(settings, get_tp_group().size)
        self.settings = settings
        self.vision_tower = SiglipVisionTower(settings)
        self.multi_modal_projector = MultiModalProjector(settings)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images * mm_tokens_per_image, text_hidden] in the module's dtype, image after image (transformers'
        get_image_features(pixel_values).pooler_output flattened)."""
        s = self.settings
        expected = (s.num_channels, s.image_size, s.image_size)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != expected or pixel_values.size(0) == 0:
            raise ValueError(f"pixel_values has shape {list(pixel_values.shape)}, the vision tower takes "
                             f"[images, {', '.join(map(str, expected))}]")
        weight = self.multi_modal_projector.mm_input_projection_weight
        pixel_values = pixel_values.to(weight.device, weight.dtype).contiguous()
        return self.multi_modal_projector(self.vision_tower(pixel_values), pixel_values.size(0))

    def checkpoint_target(self, name: str) -> tuple[str | None, tuple]:
        """Our parameter for a checkpoint tensor and the extra arguments its weight_loader takes; None for a tensor
        not the tower's or projector's (the language model's) or one never read (the pooling head)."""
        name = name.removeprefix("model.")
        if name.startswith("vision_tower."):
            inner = name.removeprefix("vision_tower.").removeprefix("vision_model.")
            if inner.startswith("head."):
                return None, ()  # the pooling head (vision_use_head): get_image_features reads last_hidden_state
            name = "vision_tower." + inner
        elif not name.startswith("multi_modal_projector."):
            return None, ()
        for checkpoint_name, (ours, shard_id) in PACKED.items():
            if f".{checkpoint_name}." in name:
                return name.replace(f".{checkpoint_name}.", f".{ours}."), (shard_id,)
        return name, ()
