"""Rotary position embedding (neox style), with a cos/sin cache indexed by position.

The inverse frequencies follow transformers' rope initialisation for each rope type (default,
linear, llama3, yarn, longrope), op for op in float32, so the cache holds the values transformers computes.
The rotation (with Qwen3's q/k norm) runs as its platform's op (tpengine/platforms). With a
partial_rotary_factor (Phi-4-mini's 0.75) only the first rotary_dim of each head turns; the rest passes.

LongRoPE has two sets of factors, short_factor's for the pre-training window (original_max_position) and
long_factor's past it, and transformers rotates each sequence with the one its length asks for (models/phi3.py):
its cache holds both, 2 x max_position rows, the short set's first; a token rotated with the long set comes
with its position plus max_position (runner/inputs.py adds it, for the rows the ledger marks long).
"""
import math
from functools import lru_cache

import torch
from torch import nn

from tpengine.hf_config import RopeParameters, rotary_dim_of
from tpengine.platforms import current_platform


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


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context extended scale times (1 for none)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(head_dim: int, rope: RopeParameters) -> tuple[torch.Tensor, float]:
    # interpolate low frequencies, extrapolate high ones, with a linear ramp between (YaRN paper)
    factor, base = rope.factor, rope.theta
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = float(yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim))
        else:
            attention_factor = yarn_mscale(factor)

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


def _longrope_inv_freq(rotary_dim: int, theta: float, ext_factors: tuple[float, ...]) -> torch.Tensor:
    shape = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
    return 1.0 / (torch.tensor(ext_factors, dtype=torch.float32, device="cpu") * theta ** shape)


def inverse_frequencies(head_dim: int, rope: RopeParameters) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] float32 on the host, the scale applied to cos and sin); head_dim is the rotated
    part of the head (rotary_dim). LongRoPE's are its short set (RotaryEmbedding adds the long one's)."""
    if rope.rope_type == "longrope":
        return _longrope_inv_freq(head_dim, rope.theta, rope.short_factor), rope.attention_factor
    if rope.rope_type == "yarn":
        return _yarn(head_dim, rope)
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(head_dim, rope), 1.0
    inv_freq = _default_inv_freq(head_dim, rope.theta)
    return (inv_freq / rope.factor if rope.rope_type == "linear" else inv_freq), 1.0


def _cos_sin_rows(max_position: int, inv_freq: torch.Tensor, attention_scaling: float) -> torch.Tensor:
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq.to(torch.get_default_device()))
    # transformers scales cos and sin (YaRN's and LongRoPE's attention factor, one for both sets; 1.0 otherwise)
    return torch.cat([freqs.cos() * attention_scaling, freqs.sin() * attention_scaling], dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, rope: RopeParameters):
        super().__init__()
        self.rotary_dim = rotary_dim_of(head_dim, rope)
        self.head_dim = head_dim
        inv_freq, attention_scaling = inverse_frequencies(self.rotary_dim, rope)
        cache = _cos_sin_rows(max_position, inv_freq, attention_scaling)
        if rope.rope_type == "longrope":  # the long set's rows after the short set's: position + max_position
            long_inv_freq = _longrope_inv_freq(self.rotary_dim, rope.theta, rope.long_factor)
            cache = torch.cat([cache, _cos_sin_rows(max_position, long_inv_freq, attention_scaling)])
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        self.qk_norm_rotary = current_platform().qk_norm_rotary

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm: nn.Module | None = None,
                k_norm: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim] rotated by each token's position
        (neox style); given q_norm and k_norm (RMSNorms over head_dim, Qwen3's), each head is normed first.
        On the CPU one C++ op does it all in place, in q and k (views of the fresh q/k/v projection)."""
        if self.rotary_dim == self.head_dim:
            return self.qk_norm_rotary(positions, q, k, q_norm, k_norm, self.cos_sin_cache)
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        # the rotated head of each q and k, then the part that passes unturned, as transformers concatenates them
        dim = self.rotary_dim
        q_rot, k_rot = self.qk_norm_rotary(positions, q[..., :dim], k[..., :dim], None, None, self.cos_sin_cache)
        if q_rot.data_ptr() == q.data_ptr() and k_rot.data_ptr() == k.data_ptr():
            return q, k  # rotated in place (the CPU's op): the rest of each head is where it was
        return torch.cat([q_rot, q[..., dim:]], dim=-1), torch.cat([k_rot, k[..., dim:]], dim=-1)


def get_rope(head_dim: int, max_position: int, rope: RopeParameters) -> RotaryEmbedding:
    """One shared instance per shape, rope and device: every layer indexes the same cos/sin cache."""
    return _cached_rope(head_dim, max_position, rope, torch.get_default_device())


@lru_cache(maxsize=None)
def _cached_rope(head_dim: int, max_position: int, rope: RopeParameters, device: torch.device) -> RotaryEmbedding:
    return RotaryEmbedding(head_dim, max_position, rope)
