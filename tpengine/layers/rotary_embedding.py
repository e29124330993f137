"""Rotary position embedding (neox style, as Qwen3), with a cos/sin cache indexed by position."""
from functools import lru_cache

import torch
from torch import nn

from tpengine.layers.compile import compiled_on_cuda


def _cos_sin(positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # [tokens, 1, head_dim / 2] each: broadcast over heads
    return cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)


def _rotate_into_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """CPU eager: each half written in place into one output, faster there than _rotate_pointwise."""
    x1, x2 = x.float().chunk(2, dim=-1)
    # [x1 cos - x2 sin, x2 cos + x1 sin], transformers' op order
    out = torch.empty(x.shape, dtype=x1.dtype, device=x.device)
    low, high = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=low).sub_(x2 * sin)
    torch.mul(x2, cos, out=high).add_(x1 * sin)
    return out.to(x.dtype)


def _rotate_pointwise(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The same values in broadcast elementwise ops alone (no out= into strided views, which
    torch.compile cannot trace, and no cat): one kernel per tensor when compiled."""
    halves = x.float().unflatten(-1, (2, -1))                     # [..., 2, head_dim / 2]: x1, x2
    # [[-1], [1]]: x1 cos - x2 sin, x2 cos + x1 sin; made on the device (no host copy: CUDA-graph safe)
    sign = torch.arange(-1, 2, 2, dtype=torch.float32, device=x.device).unsqueeze(-1)
    rotated = halves * cos.unsqueeze(-2) + halves.flip(-2) * (sign * sin.unsqueeze(-2))
    return rotated.flatten(-2).to(x.dtype)


@compiled_on_cuda
def apply_rotary_traceable(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                           cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA: compiled as one graph, one kernel each for q and k (the gather of cos/sin fused into both)."""
    cos, sin = _cos_sin(positions, cos_sin_cache)
    return _rotate_pointwise(q, cos, sin), _rotate_pointwise(k, cos, sin)


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim], rotated by each token's position."""
    if q.is_cuda:
        return apply_rotary_traceable(positions, q, k, cos_sin_cache)
    cos, sin = _cos_sin(positions, cos_sin_cache)
    return _rotate_into_halves(q, cos, sin), _rotate_into_halves(k, cos, sin)


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
