"""Multimodal rotary embedding (M-RoPE) of Qwen2.5-VL and Qwen3-VL: transformers' Qwen2_5_VLRotaryEmbedding
(mrope_section's contiguous sections of the frequencies, recomposition_frequencies) and Qwen3VLTextRotaryEmbedding
(interleaved: apply_interleaved_mrope), each followed by apply_rotary_pos_emb.

Each token has three positions (temporal, height, width; multimodal/mrope_positions.py) and each rotary frequency
turns by one of them. With 1-D positions (decode: the three equal) it is plain RoPE on the cos/sin cache, as
RotaryEmbedding. With [3, tokens] positions one cos/sin row per token is gathered, each frequency's column from
its section's position, and the platform's qk_norm_rotary turns token i by row i of that table.
"""
from functools import lru_cache

import torch
from torch import nn

from tpengine.hf_config import RopeParameters
from tpengine.layers.rotary_embedding import RotaryEmbedding


def section_rows(mrope_section: tuple[int, ...], interleaved: bool) -> list[int]:
    """For each of the rotary_dim // 2 frequencies, the positions' row (0 t, 1 h, 2 w) that turns it."""
    half = sum(mrope_section)
    if interleaved:  # Qwen3-VL: t h w t h w ..., h and w each for their first mrope_section[i] turns
        return [1 if j % 3 == 1 and j < 3 * mrope_section[1] else 2 if j % 3 == 2 and j < 3 * mrope_section[2]
                else 0 for j in range(half)]
    # Qwen2.5-VL: section i contiguous, turned by row i % 3 (transformers' recomposition_frequencies)
    return [i % 3 for i, width in enumerate(mrope_section) for _ in range(width)]


class MRotaryEmbedding(RotaryEmbedding):
    def __init__(self, head_dim: int, max_position: int, rope: RopeParameters, mrope_section: tuple[int, ...],
                 interleaved: bool = False):
        if rope.rope_type == "longrope":  # its long set shifts positions by max_position: not one M-RoPE knows
            raise ValueError("M-RoPE with longrope is not supported")
        super().__init__(head_dim, max_position, rope)
        if interleaved and len(mrope_section) != 3:
            raise ValueError(f"interleaved M-RoPE takes three sections (t, h, w), not mrope_section {mrope_section}")
        if sum(mrope_section) != self.rotary_dim // 2:
            raise ValueError(f"mrope_section {list(mrope_section)} sums to {sum(mrope_section)}, but head size "
                             f"{head_dim} (rotary_dim {self.rotary_dim}) has {self.rotary_dim // 2} frequencies")
        self.mrope_section, self.interleaved = tuple(mrope_section), interleaved
        rows = torch.tensor(section_rows(self.mrope_section, interleaved), dtype=torch.int64)
        # the cache's row holds cos then sin of each frequency: both halves take the frequency's position row
        self.register_buffer("column_rows", torch.cat([rows, rows]), persistent=False)
        self.register_buffer("columns", torch.arange(self.rotary_dim, dtype=torch.int64), persistent=False)

    def cos_sin_table(self, positions: torch.Tensor) -> torch.Tensor:
        """[tokens, rotary_dim]: row i is token i's cos/sin, each column from its section's position."""
        # indexed [tokens, rotary_dim] so the gathered table comes out contiguous, as the fused op needs
        return self.cos_sin_cache[positions.T[:, self.column_rows], self.columns].contiguous()

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm: nn.Module | None = None,
                k_norm: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """RotaryEmbedding.forward's contract; positions [tokens] (all three rows equal: plain RoPE, the decode
        path) or [3, tokens] (temporal, height, width)."""
        if positions.dim() == 1:
            return super().forward(positions, q, k, q_norm, k_norm)
        table = self.cos_sin_table(positions)
        rows = torch.arange(table.shape[0], dtype=torch.int64, device=table.device)
        return self._rotate(rows, q, k, q_norm, k_norm, table)

    def _rotate(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm, k_norm,
                cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # RotaryEmbedding.forward over another cos/sin table (it reads self.cos_sin_cache)
        if self.rotary_dim == self.head_dim:
            return self.qk_norm_rotary(positions, q, k, q_norm, k_norm, cos_sin)
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        dim = self.rotary_dim
        q_rot, k_rot = self.qk_norm_rotary(positions, q[..., :dim], k[..., :dim], None, None, cos_sin)
        if q_rot.data_ptr() == q.data_ptr() and k_rot.data_ptr() == k.data_ptr():
            return q, k  # rotated in place: the rest of each head is where it was
        return torch.cat([q_rot, q[..., dim:]], dim=-1), torch.cat([k_rot, k[..., dim:]], dim=-1)


def get_mrope(head_dim: int, max_position: int, rope: RopeParameters, mrope_section: tuple[int, ...],
              interleaved: bool = False) -> MRotaryEmbedding:
    """One shared instance per shape, rope, sections and device, as get_rope."""
    return _cached_mrope(head_dim, max_position, rope, tuple(mrope_section), interleaved, torch.get_default_device())


@lru_cache(maxsize=None)
def _cached_mrope(head_dim: int, max_position: int, rope: RopeParameters, mrope_section: tuple[int, ...],
                  interleaved: bool, device: torch.device) -> MRotaryEmbedding:
    return MRotaryEmbedding(head_dim, max_position, rope, mrope_section, interleaved)
