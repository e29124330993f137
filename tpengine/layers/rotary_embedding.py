"""Rotary position embedding (neox style, as Qwen3), with a cos/sin cache indexed by position."""
from functools import lru_cache

import torch
from torch import nn

from tpengine.layers.compile import compiled_on_cuda


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    # [x1 cos - x2 sin, x2 cos + x1 sin], each half computed in place into one output (no cat)
    out = torch.empty(x.shape, dtype=x1.dtype, device=x.device)
    low, high = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=low).sub_(x2 * sin)
    torch.mul(x2, cos, out=high).add_(x1 * sin)
    return out.to(x.dtype)


@compiled_on_cuda
def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # q: [tokens, heads, head_dim]; cos/sin broadcast over heads
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return apply_rotary(positions, q, k, self.cos_sin_cache)


def get_rope(head_dim: int, max_position: int, base: float) -> RotaryEmbedding:
    """One shared instance per shape and device: every layer indexes the same cos/sin cache."""
    return _cached_rope(head_dim, max_position, base, torch.get_default_device())


@lru_cache(maxsize=None)
def _cached_rope(head_dim: int, max_position: int, base: float, device: torch.device) -> RotaryEmbedding:
    return RotaryEmbedding(head_dim, max_position, base)
