"""Rotary position embedding (neox style), with a cos/sin cache indexed by position.

The inverse frequencies follow transformers' rope initialisation for each rope type (default,
linear, llama3, yarn), op for op in float32, so the cache holds the values transformers computes.
"""
import math
from functools import lru_cache

import torch
from torch import nn

from tpengine.hf_config import RopeParameters
from tpengine.kernels.cpu import fused_ops
from tpengine.layers.compile import compiled_on_cuda


def _default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))


def _llama3_inv_freq(head_dim: int, rope: RopeParameters) -> torch.Tensor:
    # long wavelengths divided by factor, short ones kept, a smooth blend in between (Llama 3.1)
    inv_freq = _default_inv_freq(head_dim, rope.theta)
    old_len, factor = rope.original_max_position, rope.factor
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(head_dim: int, rope: RopeParameters) -> tuple[torch.Tensor, float]:
    # interpolate low frequencies, extrapolate high ones, with a linear ramp between (YaRN paper)
    factor, base = rope.factor, rope.theta
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return (head_dim * math.log(rope.original_max_position / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, head_dim, 2, device="cpu").float() / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, attention_factor


def inverse_frequencies(head_dim: int, rope: RopeParameters) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] float32 on the host, the scale applied to cos and sin)."""
    if rope.rope_type == "yarn":
        return _yarn(head_dim, rope)
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(head_dim, rope), 1.0
    inv_freq = _default_inv_freq(head_dim, rope.theta)
    return (inv_freq / rope.factor if rope.rope_type == "linear" else inv_freq), 1.0


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
    def __init__(self, head_dim: int, max_position: int, rope: RopeParameters):
        super().__init__()
        inv_freq, attention_scaling = inverse_frequencies(head_dim, rope)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq.to(torch.get_default_device()))
        # transformers scales cos and sin (YaRN's attention factor; 1.0 for the other types)
        cos, sin = freqs.cos() * attention_scaling, freqs.sin() * attention_scaling
        self.register_buffer("cos_sin_cache", torch.cat([cos, sin], dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm: nn.Module | None = None,
                k_norm: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim] rotated by each token's position;
        given q_norm and k_norm (RMSNorms over head_dim, Qwen3's), each head is normed first. On the CPU
        one C++ op does it all in place, in q and k (views of the fresh q/k/v projection)."""
        if (fused_ops.usable(q) and q.stride(-1) == 1 and k.stride(-1) == 1 and positions.dtype == torch.int64
                and self.cos_sin_cache.dtype == torch.float32 and (q_norm is None or q_norm.eps == k_norm.eps)):
            return fused_ops.qk_norm_rotary_(q, k, None if q_norm is None else q_norm.weight,
                                             None if k_norm is None else k_norm.weight,
                                             0.0 if q_norm is None else q_norm.eps, positions, self.cos_sin_cache)
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        return apply_rotary(positions, q, k, self.cos_sin_cache)


def get_rope(head_dim: int, max_position: int, rope: RopeParameters) -> RotaryEmbedding:
    """One shared instance per shape, rope and device: every layer indexes the same cos/sin cache."""
    return _cached_rope(head_dim, max_position, rope, torch.get_default_device())


@lru_cache(maxsize=None)
def _cached_rope(head_dim: int, max_position: int, rope: RopeParameters, device: torch.device) -> RotaryEmbedding:
    return RotaryEmbedding(head_dim, max_position, rope)
