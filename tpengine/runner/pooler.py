"""Embedding requests' vectors, on rank 0 (every tensor-parallel rank holds the whole last hidden states): each
pooled prompt chunk's rows pooled as the checkpoint says (the last token's, the mean, or the first token's), then
shortened (Matryoshka) and normalized as its request asks, when the chunk reaches the prompt's end. A mean over a
prompt in several chunks is summed chunk by chunk. A classifier's vector is its head's logits for the last token,
through the sigmoid (one label) or the softmax where the request keeps the activation."""
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tpengine.attention.metadata import AttentionMetadata
from tpengine.distributed.messages import PrefillChunk
from tpengine.pooling import PoolingConfig


class Pooler:
    def __init__(self, config: PoolingConfig, classify: Callable[[torch.Tensor], torch.Tensor] | None = None):
        """classify: the model's classifier head (hidden states -> float32 logits), for a classifier's config."""
        assert not config.classifies or classify is not None
        self.method = config.method
        self.classify = classify if config.classifies else None
        # a prompt's pooled rows so far (mean: their float32 sum; CLS: its first row), by sequence
        self.partial: dict[int, torch.Tensor] = {}

    def pool(self, chunks: list[PrefillChunk], meta: AttentionMetadata,
             hidden_states: torch.Tensor) -> dict[int, list[float]]:
        """The vectors of the step's pooled chunks that reach their prompts' ends, by sequence id; chunks: the
        step's prompt chunks in row order (after the decode rows)."""
        vectors = {}
        start = meta.num_decode_tokens
        for chunk, length in zip(chunks, meta.seqlens_q):
            if chunk.pooling is not None:
                vector = self._pool_rows(chunk, hidden_states[start:start + length])
                if vector is not None:
                    vectors[chunk.seq_id] = vector
            start += length
        return vectors

    def forget(self, released: list[int]) -> None:
        """Sequences that left the ranks (finished, aborted, preempted): a sum in progress is dropped."""
        for seq_id in released:
            self.partial.pop(seq_id, None)

    def _pool_rows(self, chunk: PrefillChunk, rows: torch.Tensor) -> list[float] | None:
        seq_id, first = chunk.seq_id, chunk.num_cached_tokens == 0
        if self.method == "mean":
            total = rows.float().sum(dim=0)
            self.partial[seq_id] = total if first else self.partial[seq_id] + total
        elif self.method == "cls" and first:
            self.partial[seq_id] = rows[0].float()
        if not chunk.pooling.final:
            return None
        if self.classify is not None:
            return self._classified(rows[-1:], chunk.pooling.activation)
        if self.method == "last":
            vector = rows[-1].float()
        else:
            vector = self.partial.pop(seq_id)
            if self.method == "mean":
                vector = vector / (chunk.num_cached_tokens + rows.size(0))
        if chunk.pooling.dimensions:
            vector = vector[:chunk.pooling.dimensions]
        if chunk.pooling.normalize:
            vector = F.normalize(vector, p=2, dim=-1)  # sentence-transformers' Normalize
        return vector.tolist()

    def _classified(self, last_row: torch.Tensor, activation: bool) -> list[float]:
        logits = self.classify(last_row)[0]
        if not activation:
            return logits.tolist()
        return (torch.sigmoid(logits) if logits.numel() == 1 else torch.softmax(logits, dim=-1)).tolist()
