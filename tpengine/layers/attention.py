"""Attention over this rank's shard of the paged KV cache, through the chosen backend."""
import torch
from torch import nn

from tpengine.attention.backend import AttentionBackend
from tpengine.attention.metadata import AttentionMetadata


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 backend: AttentionBackend):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend = backend
        # Bound to views of the runner's cache tensor once it is allocated.
        self.k_cache = self.v_cache = torch.tensor([])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim]
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
