"""Paged attention through flash-attn (CUDA, fp16/bf16, kvcache_block_size a multiple of 256).

Imported only by make_backend when this backend is chosen, so flash_attn is needed only then.
Triton is not needed: its store kernel is used when Triton imports (any version), else the torch store.
"""
from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

from tpengine.attention.backend import AttentionBackend, AttentionParams
from tpengine.attention.metadata import AttentionMetadata
from tpengine.platforms.torch_ops import store_kvcache_masked

try:
    from tpengine.kernels.triton.store_kvcache import store_kvcache as triton_store_kvcache
except ImportError:
    triton_store_kvcache = None


def _window_size(params: AttentionParams) -> tuple[int, int]:
    """flash-attn's (left, right) keys around each query: the query and window - 1 keys before it; -1 = all."""
    return (params.sliding_window - 1, 0) if params.sliding_window is not None else (-1, -1)


class FlashAttnBackend(AttentionBackend):
    name = "flash_attn"
    # the torch store's mask syncs with the host, which capture forbids: without Triton, decode is eager
    cuda_graph_safe = triton_store_kvcache is not None
    reads_key_ends = False  # its varlen kernel is causal or full, no per-row limit

    def check(self, params: AttentionParams) -> None:
        if params.sinks is not None:
            raise ValueError("attention_backend='flash_attn' has no attention sinks, which this model's layers "
                             "have; use attention_backend='triton'")

    def store_kvcache(self, k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
        # both skip slot -1 (a padding row); the cache is the model's dtype (flash-attn 2 reads no FP8 KV)
        (triton_store_kvcache or store_kvcache_masked)(k, v, k_cache, v_cache, slot_mapping)

    def prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, params: AttentionParams):
        block_table = None
        if meta.has_cached_prefix:
            # a prefix computed in an earlier step is only in the cache: read every key through the block
            # table (the store above has just put this step's keys there too)
            k, v, block_table = k_cache, v_cache, meta.block_tables
        return flash_attn_varlen_func(q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q,
                                      meta.max_seqlen_k, softmax_scale=params.scale, causal=True,
                                      window_size=_window_size(params), softcap=params.softcap,
                                      block_table=block_table)

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, params: AttentionParams):
        # one query per sequence, the last of its context_lens[b] cached tokens
        return flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.context_lens,
                                       block_table=meta.block_tables, softmax_scale=params.scale, causal=True,
                                       window_size=_window_size(params), softcap=params.softcap).squeeze(1)
