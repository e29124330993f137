"""Paged attention through the Triton kernels in tpengine.kernels.triton (CUDA, or CPU under TRITON_INTERPRET=1)."""
from tpengine.attention.backend import AttentionBackend, AttentionParams
from tpengine.attention.kv_cache_dtype import is_fp8
from tpengine.attention.metadata import AttentionMetadata
from tpengine.kernels.triton.latent_decode_attention import latent_decode_attention
from tpengine.kernels.triton.paged_decode_attention import paged_decode_attention
from tpengine.kernels.triton.paged_prefill_attention import paged_prefill_attention
from tpengine.kernels.triton.store_kvcache import store_kvcache


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    cuda_graph_safe = True

    def store_kvcache(self, k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
        store_kvcache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, params: AttentionParams):
        # every key, the new tokens' too, is read back through the block table after the store
        return paged_prefill_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.cu_seqlens_k,
                                       meta.block_tables, params.scale, meta.max_seqlen_q, window=params.window,
                                       softcap=params.softcap, sinks=params.sinks, k_scale=params.k_scale,
                                       v_scale=params.v_scale, key_ends=meta.key_ends)

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, params: AttentionParams):
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, params.scale,
                                      window=params.window, softcap=params.softcap, sinks=params.sinks,
                                      k_scale=params.k_scale, v_scale=params.v_scale)

    def decode_latent(self, q, cache, meta: AttentionMetadata, params: AttentionParams, latent_dim: int):
        if is_fp8(cache.dtype):  # the latent kernel reads the model's dtype only
            return super().decode_latent(q, cache, meta, params, latent_dim)
        return latent_decode_attention(q, cache, meta.block_tables, meta.context_lens, params.scale, latent_dim)
