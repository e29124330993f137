"""Attention backends behind one seam; `resolve_backend_name` picks one for the device, block size, dtype and
KV-cache dtype. An FP8 KV cache runs on 'triton' and 'torch': flash-attn 2 reads no FP8 KV, and the CPU's C++
decode kernel reads the model's dtype only, so 'auto' takes 'triton' on CUDA and 'torch' on the CPU for it."""
import importlib.util
import logging

import torch

from tpengine.attention.backend import AttentionBackend
from tpengine.attention.kv_cache_dtype import is_fp8
from tpengine.attention.metadata import AttentionMetadata

logger = logging.getLogger("tpengine")


# the first Triton with triton.knobs, which the attention kernels read (setup.cfg pins the same)
TRITON_MIN_VERSION = "3.4"
FLASH_ATTN_BLOCK_MULTIPLE = 256  # flash-attn's paged KV: page_block_size must be a multiple of 256
FLASH_ATTN_MAX_HEAD_DIM = 256  # flash-attn 2's widest head
FLASH_ATTN_DTYPES = (torch.float16, torch.bfloat16)
FP8_KV_MIN_CAPABILITY = (8, 9)  # Triton's e4m3 (fp8e4nv) conversions: Ada and Hopper, not Ampere
FP8_KV_NOTE = "kv_cache_dtype='fp8' runs on attention_backend 'triton' or 'torch'"


def flash_attn_problem(device: torch.device, block_size: int, dtype: torch.dtype | None = None,
                       kv_cache_dtype: torch.dtype | None = None, head_dim: int | None = None) -> str | None:
    """Why flash_attn cannot run with these settings, or None; the device is checked first."""
    if device.type != "cuda":
        return f"needs CUDA, and the engine runs on {device.type}"
    if head_dim is not None and head_dim > FLASH_ATTN_MAX_HEAD_DIM:
        return f"takes heads up to {FLASH_ATTN_MAX_HEAD_DIM} wide, and the model's cached heads are {head_dim}"
    if is_fp8(kv_cache_dtype):
        return f"has no FP8 KV cache (flash-attn 2 reads none); {FP8_KV_NOTE}"
    if block_size % FLASH_ATTN_BLOCK_MULTIPLE:
        return (f"needs kvcache_block_size to be a multiple of {FLASH_ATTN_BLOCK_MULTIPLE} "
                f"(flash-attn's paged-KV rule), got {block_size}")
    if dtype is not None and dtype not in FLASH_ATTN_DTYPES:
        return f"needs dtype float16 or bfloat16, got {str(dtype).removeprefix('torch.')}"
    if importlib.util.find_spec("flash_attn") is None:
        return "needs the flash-attn package (pip install 'tpengine[cuda]')"
    return None


def triton_problem(device: torch.device, kv_cache_dtype: torch.dtype | None = None) -> str | None:
    """Why the triton backend cannot run here, or None. Imports triton: only this backend needs it."""
    try:
        import triton
    except ImportError as error:
        return f"needs the triton package (pip install 'tpengine[triton]'): {error}"
    try:
        from triton import knobs
    except ImportError:
        return f"needs triton >= {TRITON_MIN_VERSION} (it has triton.knobs), found {triton.__version__}"
    if device.type == "cpu" and not knobs.runtime.interpret:
        return ("runs on the CPU only in Triton's interpreter (TRITON_INTERPRET=1, for tests); "
                "use attention_backend='cpu' or 'torch'")
    if is_fp8(kv_cache_dtype) and device.type == "cuda" and \
            torch.cuda.get_device_capability(device) < FP8_KV_MIN_CAPABILITY:
        major, minor = torch.cuda.get_device_capability(device)
        return (f"has no FP8 KV cache on this GPU (compute capability {major}.{minor}; Triton's e4m3 needs "
                f"{FP8_KV_MIN_CAPABILITY[0]}.{FP8_KV_MIN_CAPABILITY[1]} or newer); use attention_backend='torch'")
    return None


def cpu_kernel_problem(device: torch.device, kv_cache_dtype: torch.dtype | None = None) -> str | None:
    """Why the cpu backend cannot run here, or None; builds its C++ kernel on first use on this machine."""
    if device.type != "cpu":
        return f"runs on the CPU, and the engine runs on {device.type}"
    if is_fp8(kv_cache_dtype):
        return f"has no FP8 KV cache (its C++ decode kernel reads the model's dtype); {FP8_KV_NOTE}"
    from tpengine.kernels.cpu import paged_decode_attention as cpu_paged_attention
    try:
        cpu_paged_attention.load()
    except (RuntimeError, OSError) as error:  # no compiler, a failed build, an unwritable cache folder
        return f"needs its C++ kernel, which could not be built or loaded: {error}"
    return None


def resolve_backend_name(name: str, device: torch.device, block_size: int, dtype: torch.dtype | None = None,
                         kv_cache_dtype: torch.dtype | None = None, batch_invariant: bool = False,
                         head_dim: int | None = None) -> str:
    """The backend that `name` means here; ValueError when it cannot run. kv_cache_dtype: None or the model's
    dtype for a cache of the model's dtype; batch_invariant: auto never picks flash-attn (make_backend); head_dim:
    the width of a cached KV head (latent attention's is wider than flash-attn takes)."""
    if name == "auto":
        if device.type == "cuda":
            if flash_attn_problem(device, block_size, dtype, head_dim=head_dim) is None and not batch_invariant:
                if not is_fp8(kv_cache_dtype):
                    return "flash_attn"
                logger.info("attention backend 'triton', not 'flash_attn': flash-attn 2 has no FP8 KV cache")
            problem = triton_problem(device, kv_cache_dtype)
            if problem is None:
                return "triton"
            logger.warning("attention backend 'triton' %s; using 'torch', which decodes without CUDA graphs",
                           problem)
            return "torch"
        if is_fp8(kv_cache_dtype):
            logger.info("attention backend 'torch', not 'cpu': the C++ decode kernel has no FP8 KV cache")
            return "torch"
        problem = cpu_kernel_problem(device)
        if problem is None:
            return "cpu"
        logger.warning("attention backend 'cpu' %s; using 'torch', several times slower in decode", problem)
        return "torch"
    if name == "cpu":
        problem = cpu_kernel_problem(device, kv_cache_dtype)
        if problem is not None:
            raise ValueError(f"attention_backend='cpu' {problem}")
    if name == "flash_attn":
        problem = flash_attn_problem(device, block_size, dtype, kv_cache_dtype, head_dim)
        if problem is not None:
            raise ValueError(f"attention_backend='flash_attn' {problem}")
    if name == "triton":
        problem = triton_problem(device, kv_cache_dtype)
        if problem is not None:
            raise ValueError(f"attention_backend='triton' {problem}")
    return name


def make_backend(name: str, batch_invariant: bool = False) -> AttentionBackend:
    """The named backend; batch_invariant: every token through its decode kernel, unsplit (batch_invariant.py)."""
    if batch_invariant:
        if name == "flash_attn":
            raise ValueError("batch_invariant needs the triton attention backend on CUDA: flash-attn picks its "
                             "key splits by the batch")
        from tpengine.attention.batch_invariant import BatchInvariantAttention
        if name == "cpu":
            from tpengine.attention.cpu_backend import CpuAttentionBackend
            return BatchInvariantAttention(CpuAttentionBackend(split_keys=False))
        return BatchInvariantAttention(make_backend(name))
    if name == "torch":
        from tpengine.attention.torch_backend import TorchAttentionBackend
        return TorchAttentionBackend()
    if name == "cpu":
        from tpengine.attention.cpu_backend import CpuAttentionBackend
        return CpuAttentionBackend()
    if name == "triton":
        from tpengine.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend()
    if name == "flash_attn":
        from tpengine.attention.flash_attn_backend import FlashAttnBackend
        return FlashAttnBackend()
    raise ValueError(f"unknown attention backend {name!r}")


__all__ = ["AttentionBackend", "AttentionMetadata", "make_backend", "resolve_backend_name"]
