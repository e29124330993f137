"""The CPU's paged attention: the torch backend's prefill, and decode through the C++ kernel in
tpengine.kernels.cpu.paged_decode_attention, which reads each sequence's K/V in place in one pass.
The new K/V go into the cache through one C++ op (kernels/cpu/fused_ops.cpp): no mask, no host sync."""
from tpengine.attention.metadata import AttentionMetadata
from tpengine.attention.torch_backend import TorchAttentionBackend, store_kvcache_masked
from tpengine.kernels.cpu import fused_ops
from tpengine.kernels.cpu.paged_decode_attention import paged_decode_attention


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def store_kvcache(self, k, v, k_cache, v_cache, slot_mapping):
        if fused_ops.usable(k) and k.stride(-1) == 1 and v.stride(-1) == 1:
            fused_ops.store_kvcache(k, v, k_cache, v_cache, slot_mapping)
        else:
            store_kvcache_masked(k, v, k_cache, v_cache, slot_mapping)

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale):
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
