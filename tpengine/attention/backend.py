"""The seam every attention backend fills: store the new K/V, then attend."""
from abc import ABC, abstractmethod

import torch

from tpengine.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    name: str
    # its store and decode run without a host sync, so a decode step can be captured in a CUDA graph
    cuda_graph_safe: bool = False

    @abstractmethod
    def store_kvcache(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
        """k, v: [num_tokens, num_kv_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim]."""

    @abstractmethod
    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Causal varlen attention of the new tokens over each sequence's cached prefix and themselves."""

    @abstractmethod
    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        """One query per sequence over its paged context."""

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        self.store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
        if not meta.is_prefill:
            return self.decode(q, k_cache, v_cache, meta, scale)
        n = meta.num_decode_tokens
        if not n:
            return self.prefill(q, k, v, k_cache, v_cache, meta, scale)
        # A mixed step: a decode token is a one-token chunk over a cached prefix, so the prefill call could
        # take it too; the decode kernel serves those rows faster. Both read K/V stored just above.
        out = torch.empty_like(q)
        out[:n] = self.decode(q[:n], k_cache, v_cache, meta.decode, scale)
        out[n:] = self.prefill(q[n:], k[n:], v[n:], k_cache, v_cache, meta, scale)
        return out
