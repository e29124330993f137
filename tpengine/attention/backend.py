"""The seam every attention backend fills: store the new K/V, then attend."""
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from tpengine.attention.metadata import AttentionMetadata


@dataclass(frozen=True, eq=False)
class AttentionParams:
    """What one layer's attention computes: softmax(scale * q k^T) v over its keys, with these changes.

    sliding_window: query at position i sees keys at positions i - sliding_window < j <= i (transformers'
        rule), so blocks wholly before that are never read; None: every earlier position.
    logit_softcap: scores become logit_softcap * tanh(scores / logit_softcap) before the mask (Gemma 2).
    sinks: [num_heads] this rank's heads' sink logits, one more softmax term that has no value (gpt-oss).
    k_scale, v_scale: float32 [1] each, the per-tensor scales of an FP8 KV cache (kv_cache_dtype.py); the layer's
        parameters, so a checkpoint's scales load into them in place.
    """
    scale: float
    sliding_window: int | None = None
    logit_softcap: float | None = None
    sinks: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    def __post_init__(self):
        assert self.sliding_window is None or self.sliding_window >= 1
        assert self.logit_softcap is None or self.logit_softcap > 0

    @property
    def window(self) -> int:
        """sliding_window for the kernels, which take 0 for none."""
        return self.sliding_window or 0

    @property
    def softcap(self) -> float:
        """logit_softcap for the kernels, which take 0 for none."""
        return self.logit_softcap or 0.0


class AttentionBackend(ABC):
    name: str
    # its store and decode run without a host sync, so a decode step can be captured in a CUDA graph
    cuda_graph_safe: bool = False
    # its store and decode read only tensors (no host lists), so a recorded CPU decode forward can be replayed
    decode_reads_only_tensors: bool = False

    # its prefill takes AttentionMetadata.key_ends (rows that see keys past their own position)
    reads_key_ends: bool = True

    def check(self, params: AttentionParams) -> None:
        """ValueError naming what of a layer's attention this backend cannot compute; it computes it all here."""

    @abstractmethod
    def store_kvcache(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> None:
        """k, v: [num_tokens, num_kv_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim]; an
        FP8 cache takes e4m3(x / scale) (k_scale, v_scale: AttentionParams')."""

    @abstractmethod
    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, params: AttentionParams) -> torch.Tensor:
        """Causal varlen attention of the new tokens over each sequence's cached prefix and themselves; a row sees
        up to meta.key_ends' position where they are given."""

    @abstractmethod
    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               params: AttentionParams) -> torch.Tensor:
        """One query per sequence over its paged context."""

    def decode_latent(self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, params: AttentionParams,
                      latent_dim: int) -> torch.Tensor:
        """Latent attention's decode (layers/latent_attention.py): one query per sequence per head over its cached
        vectors, cache [num_blocks, block_size, 1, width] being both keys and values; the first latent_dim columns
        of each head's output. Here as any MQA decode; a backend with a kernel for it reads each vector once."""
        return self.decode(q, cache, cache, meta, params)[..., :latent_dim]

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, params: AttentionParams) -> torch.Tensor:
        self.store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping, params.k_scale, params.v_scale)
        if not meta.is_prefill:
            return self.decode(q, k_cache, v_cache, meta, params)
        n = meta.num_decode_tokens
        if not n:
            return self.prefill(q, k, v, k_cache, v_cache, meta, params)
        # A mixed step: a decode token is a one-token chunk over a cached prefix, so the prefill call could
        # take it too; the decode kernel serves those rows faster. Both read K/V stored just above.
        out = torch.empty_like(q)
        out[:n] = self.decode(q[:n], k_cache, v_cache, meta.decode, params)
        out[n:] = self.prefill(q[n:], k[n:], v[n:], k_cache, v_cache, meta, params)
        return out
