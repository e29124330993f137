"""Triton kernels for the paged KV cache and attention."""

from .paged_decode_attention import paged_decode_attention
from .paged_prefill_attention import paged_prefill_attention
from .store_kvcache import store_kvcache

__all__ = ["paged_decode_attention", "paged_prefill_attention", "store_kvcache"]
