"""Attention backends behind one seam; `select_backend` picks one for the device and block size."""
import importlib.util
import logging

import torch

from tpengine.attention.backend import AttentionBackend
from tpengine.attention.metadata import AttentionMetadata

logger = logging.getLogger("tpengine")


def flash_attn_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


def resolve_backend_name(name: str, device: torch.device, block_size: int) -> str:
    """The backend that `name` means here; ValueError when it cannot run."""
    if name == "auto":
        if device.type == "cuda":
            if flash_attn_available() and block_size % 256 == 0:
                return "flash_attn"
            if importlib.util.find_spec("triton") is not None:
                return "triton"
        return "torch"
    if name == "flash_attn":
        if device.type != "cuda" or not flash_attn_available():
            raise ValueError("attention_backend='flash_attn' needs CUDA and the flash-attn package "
                             "(pip install 'tpengine[cuda]')")
        if block_size % 256:
            raise ValueError(f"attention_backend='flash_attn' needs kvcache_block_size to be a multiple of 256 "
                             f"(flash-attn's paged-KV rule), got {block_size}")
    if name == "triton" and importlib.util.find_spec("triton") is None:
        raise ValueError("attention_backend='triton' needs the triton package (pip install 'tpengine[triton]')")
    return name


def make_backend(name: str) -> AttentionBackend:
    if name == "torch":
        from tpengine.attention.torch_backend import TorchAttentionBackend
        return TorchAttentionBackend()
    if name == "triton":
        from tpengine.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend()
    if name == "flash_attn":
        from tpengine.attention.flash_attn_backend import FlashAttnBackend
        return FlashAttnBackend()
    raise ValueError(f"unknown attention backend {name!r}")


__all__ = ["AttentionBackend", "AttentionMetadata", "make_backend", "resolve_backend_name"]
