"""Batch-invariant attention (EngineConfig.batch_invariant): every query token, a prompt's as a decode row's, goes
through the backend's decode kernel as one row over its own paged context, never split across threads. A token's
reduction then runs over the same keys in the same order whatever else shares the step, however its prompt was
chunked, and whether its prefix came from the cache; the flash-style prefill, whose tiles follow the chunk, is not
used."""
import torch

from tpengine.attention.backend import AttentionBackend, AttentionParams
from tpengine.attention.metadata import AttentionMetadata


class BatchInvariantAttention(AttentionBackend):
    def __init__(self, inner: AttentionBackend):
        self.inner = inner
        self.name = f"{inner.name} (batch-invariant)"
        self.cuda_graph_safe = inner.cuda_graph_safe
        self.decode_reads_only_tensors = inner.decode_reads_only_tensors
        self.reads_key_ends = False  # a prompt row runs as a decode row: its window would trail its key end
        self._rows_for: tuple[AttentionMetadata, AttentionMetadata] | None = None  # one step's rows, built once

    def check(self, params: AttentionParams) -> None:
        self.inner.check(params)

    def store_kvcache(self, k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
        self.inner.store_kvcache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, params: AttentionParams):
        return self.inner.decode(q, k_cache, v_cache, self._token_rows(meta), params)

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, params: AttentionParams):
        return self.inner.decode(q, k_cache, v_cache, meta, params)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, params: AttentionParams) -> torch.Tensor:
        self.store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping, params.k_scale, params.v_scale)
        if not meta.is_prefill:
            return self.decode(q, k_cache, v_cache, meta, params)
        return self.prefill(q, k, v, k_cache, v_cache, meta, params)

    def _token_rows(self, meta: AttentionMetadata) -> AttentionMetadata:
        """Decode metadata with one row per token of the step (its decode rows first, as the step orders them):
        a prompt token at position p attends over its sequence's first p + 1 cached keys."""
        if self._rows_for is not None and self._rows_for[0] is meta:
            return self._rows_for[1]
        tables, lens = [], []
        if meta.num_decode_tokens:
            decode = meta.decode
            tables += decode.block_tables_list if decode.block_tables_list is not None else \
                decode.block_tables.tolist()
            lens += decode.seqlens_k if decode.seqlens_k is not None else decode.context_lens.tolist()
        prompt_tables = meta.block_tables_list if meta.block_tables_list is not None else meta.block_tables.tolist()
        for table, len_q, len_k in zip(prompt_tables, meta.seqlens_q, meta.seqlens_k):
            tables += [table] * len_q
            lens += range(len_k - len_q + 1, len_k + 1)
        width = max(len(table) for table in tables)
        padded = [list(table) + [0] * (width - len(table)) for table in tables]
        device = meta.slot_mapping.device
        rows = AttentionMetadata(
            is_prefill=False, slot_mapping=meta.slot_mapping,
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device), block_tables_list=padded,
            seqlens_k=lens, context_lens=torch.tensor(lens, dtype=torch.int32, device=device))
        self._rows_for = (meta, rows)
        return rows
