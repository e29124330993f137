"""The CPU's paged attention: prompt chunks over at most KERNEL_MAX_KEYS keys through the C++ kernel in
tpengine.kernels.cpu.prefill_attention (the torch backend's SDPA for longer ones, and for a layer the kernel does not
take: soft caps, sinks, a head_dim off its vector width), and decode
through the C++ kernel in tpengine.kernels.cpu.paged_decode_attention, which reads each sequence's K/V in place in
one pass. The new K/V go into the cache through the CPU platform's store (one C++ op): no mask, no host sync."""
import itertools
from dataclasses import dataclass

import torch

from tpengine.attention.backend import AttentionParams
from tpengine.attention.metadata import AttentionMetadata
from tpengine.attention.torch_backend import TorchAttentionBackend
from tpengine.kernels.cpu import prefill_attention
from tpengine.kernels.cpu.paged_decode_attention import paged_decode_attention
from tpengine.platforms import cpu


# a prompt chunk over a cached prefix with at most this many rows goes to the decode kernel, a row each (a row is a
# decode row over the keys up to its own); a longer one is attended over its gathered keys. The short ones are what a
# step of prefix hits holds (a whole-prompt hit computes its last token again): one at a time, each chunk's gather,
# mask and SDPA per layer made such a step twice as slow as one without hits (docs/benchmarks.md)
MAX_CHUNK_ROWS_AS_DECODE = 16
# a prompt chunk over at most this many keys runs the C++ prefill kernel: 256 queries over 256 keys took 0.7-0.95x
# SDPA's time (one Zen 4 core and two, head_dim 32 and 128); over 1024-2048 keys it ranged 0.95-1.3x (its key blocks
# stream from L2 once per four query rows) where SDPA held steady (docs/benchmarks.md)
KERNEL_MAX_KEYS = 512


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
        plan = meta.backend_plan
        if not isinstance(plan, ShortChunkRows):  # the step's first layer
            plan = meta.backend_plan = ShortChunkRows.of(meta)
        if not plan.rows.numel() or v_cache.size(-1) != q.size(-1):  # none, or a latent cache's narrower values
            return super().prefill(q, k, v, k_cache, v_cache, meta, params)
        out = torch.empty_like(q)
        out[plan.rows] = paged_decode_attention(
            q[plan.rows], k_cache, v_cache, plan.block_tables, plan.context_lens, params.scale, window=params.window,
            softcap=params.softcap, sinks=params.sinks, max_splits=self.max_splits)
        self.prefill_chunks(q, k, v, k_cache, v_cache, meta, params, out, plan.other_chunks)
        return out

    def attend_chunk(self, q, k, v, key_start: int, params: AttentionParams, key_ends, out: torch.Tensor) -> None:
        # SDPA for what the kernel does not take, and over more keys than KERNEL_MAX_KEYS
        if (key_ends is None and params.logit_softcap is None and params.sinks is None and k.size(0) <= KERNEL_MAX_KEYS
                and prefill_attention.takes(q)):
            prefill_attention.prefill_attention(q, k, v, params.scale, params.window, out=out)
        else:
            super().attend_chunk(q, k, v, key_start, params, key_ends, out)

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, params: AttentionParams):
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, params.scale,
                                      window=params.window, softcap=params.softcap, sinks=params.sinks,
                                      max_splits=self.max_splits)

    def decode_latent(self, q, cache, meta: AttentionMetadata, params: AttentionParams, latent_dim: int):
        # the values are a view of the latents' columns: the rotary ones are never summed
        return paged_decode_attention(q, cache, cache[..., :latent_dim], meta.block_tables, meta.context_lens,
                                      params.scale, max_splits=self.max_splits)


@dataclass
class ShortChunkRows:
    """A prefill step's chunks over a cached prefix with at most MAX_CHUNK_ROWS_AS_DECODE rows, as decode rows: their
    rows of the step, each row's block table and context (its keys up to its own); and the step's other chunks."""
    rows: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    other_chunks: list[int]

    @classmethod
    def of(cls, meta: AttentionMetadata) -> "ShortChunkRows":
        rows, tables, context_lens, other_chunks = [], [], [], []
        usable = meta.has_cached_prefix and meta.key_ends is None  # images' rows see past their own: SDPA's mask
        starts = itertools.accumulate(meta.seqlens_q, initial=0)
        for b, (start, len_q, len_k) in enumerate(zip(starts, meta.seqlens_q, meta.seqlens_k)):
            if not (usable and len_k > len_q and len_q <= MAX_CHUNK_ROWS_AS_DECODE):
                other_chunks.append(b)
                continue
            rows.extend(range(start, start + len_q))
            tables.extend([b] * len_q)
            context_lens.extend(range(len_k - len_q + 1, len_k + 1))
        block_tables = meta.block_tables[torch.tensor(tables, dtype=torch.long)] if tables else meta.block_tables[:0]
        return cls(torch.tensor(rows, dtype=torch.long), block_tables, torch.tensor(context_lens, dtype=torch.int32),
                   other_chunks)
