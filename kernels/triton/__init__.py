"""Triton kernels for the paged KV cache and attention, one module each.

Nothing is imported here: the flash-attn backend takes only the store kernel, which runs on any
Triton, while the attention kernels need triton.knobs (Triton >= 3.4).
"""
