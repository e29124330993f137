"""The CPU's paged attention: the torch backend's prefill, and decode through the C++ kernel in
tpengine.kernels.cpu.paged_decode_attention, which reads each sequence's K/V in place in one pass.
The new K/V go into the cache through the CPU platform's store (one C++ op): no mask, no host sync."""
import itertools

import torch

from tpengine.attention.backend import AttentionParams
from tpengine.attention.metadata import AttentionMetadata
from tpengine.attention.torch_backend import TorchAttentionBackend
from tpengine.kernels.cpu.paged_decode_attention import paged_decode_attention
from tpengine.platforms import cpu


# a prompt chunk over a cached prefix with at most this many rows goes to the decode kernel, a row each (a row is a
# decode row over the keys up to its own); a longer one is SDPA over its gathered keys. The short ones are what a
# step of prefix hits holds (a whole-prompt hit computes its last token again): one at a time, each chunk's gather,
# mask and SDPA per layer made such a step twice as slow as one without hits (docs/benchmarks.md)
MAX_CHUNK_ROWS_AS_DECODE = 16


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"
    decode_reads_only_tensors = True  # block tables, context lens and slots as tensors, read in C++

    def __init__(self, split_keys: bool = True):
        # split_keys: a small batch's keys run on several threads (faster; the sums' order follows the batch)
        self.max_splits = 0 if split_keys else 1

    def store_kvcache(self, k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
        # the C++ store where it takes the tensors, else torch's; the cache is the model's dtype (no FP8 here)
        cpu.store_kvcache(k, v, k_cache, v_cache, slot_mapping)

    def prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, params: AttentionParams):
        short = _short_cached_chunks(meta) if meta.has_cached_prefix and meta.key_ends is None \
            and v_cache.size(-1) == q.size(-1) else []
        if not short:
            return super().prefill(q, k, v, k_cache, v_cache, meta, params)
        out = torch.empty_like(q)
        rows, tables, context_lens = [], [], []
        starts = list(itertools.accumulate(meta.seqlens_q, initial=0))
        for b in short:
            len_q, len_k = meta.seqlens_q[b], meta.seqlens_k[b]
            rows.extend(range(starts[b], starts[b] + len_q))
            tables.extend([b] * len_q)
            context_lens.extend(range(len_k - len_q + 1, len_k + 1))  # each row sees the keys up to its own
        rows = torch.tensor(rows)
        out[rows] = paged_decode_attention(
            q[rows], k_cache, v_cache, meta.block_tables[torch.tensor(tables)],
            torch.tensor(context_lens, dtype=torch.int32), params.scale, window=params.window,
            softcap=params.softcap, sinks=params.sinks, max_splits=self.max_splits)
        short = set(short)
        self.prefill_chunks(q, k, v, k_cache, v_cache, meta, params, out,
                            [b for b in range(len(meta.seqlens_q)) if b not in short])
        return out

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, params: AttentionParams):
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, params.scale,
                                      window=params.window, softcap=params.softcap, sinks=params.sinks,
                                      max_splits=self.max_splits)

    def decode_latent(self, q, cache, meta: AttentionMetadata, params: AttentionParams, latent_dim: int):
        # the values are a view of the latents' columns: the rotary ones are never summed
        return paged_decode_attention(q, cache, cache[..., :latent_dim], meta.block_tables, meta.context_lens,
                                      params.scale, max_splits=self.max_splits)


def _short_cached_chunks(meta: AttentionMetadata) -> list[int]:
    """The chunks (indices into meta.seqlens_q) over a cached prefix with at most MAX_CHUNK_ROWS_AS_DECODE rows."""
    return [b for b, (len_q, len_k) in enumerate(zip(meta.seqlens_q, meta.seqlens_k))
            if len_k > len_q and len_q <= MAX_CHUNK_ROWS_AS_DECODE]
