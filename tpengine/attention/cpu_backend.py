"""The CPU's paged attention: the torch backend's prefill, and decode through the C++ kernel in
tpengine.kernels.cpu.paged_decode_attention, which reads each sequence's K/V in place in one pass.
The new K/V go into the cache through the CPU platform's store (one C++ op): no mask, no host sync."""
from tpengine.attention.backend import AttentionParams
from tpengine.attention.metadata import AttentionMetadata
from tpengine.attention.torch_backend import TorchAttentionBackend
from tpengine.kernels.cpu.paged_decode_attention import paged_decode_attention
from tpengine.platforms import cpu


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"
    decode_reads_only_tensors = True  # block tables, context lens and slots as tensors, read in C++

    def __init__(self, split_keys: bool = True):
        # split_keys: a small batch's keys run on several threads (faster; the sums' order follows the batch)
        self.max_splits = 0 if split_keys else 1

    def store_kvcache(self, k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
        # the C++ store where it takes the tensors, else torch's; the cache is the model's dtype (no FP8 here)
        cpu.store_kvcache(k, v, k_cache, v_cache, slot_mapping)

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, params: AttentionParams):
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, params.scale,
                                      window=params.window, softcap=params.softcap, sinks=params.sinks,
                                      max_splits=self.max_splits)

    def decode_latent(self, q, cache, meta: AttentionMetadata, params: AttentionParams, latent_dim: int):
        # the values are a view of the latents' columns: the rotary ones are never summed
        return paged_decode_attention(q, cache, cache[..., :latent_dim], meta.block_tables, meta.context_lens,
                                      params.scale, max_splits=self.max_splits)
