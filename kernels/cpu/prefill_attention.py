"""The C++ prefill attention for the CPU (prefill_attention.cpp), built on first use by kernels/cpu/build.py and
loaded as the torch op `torch.ops.tpengine_prefill.prefill_attention`: one sequence's chunk of queries over its
keys, causal, within a sliding window if the layer has one. The CPU attention backend takes it for the plain
layers (no soft cap, no sinks) in place of torch's SDPA, for chunks over at most 512 keys (cpu_backend.py)."""
import functools

import torch

from tpengine.kernels.cpu.build import build_and_load, build_and_load_or_warn, cpu_flags

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def vector_width() -> int:
    """Floats in one of the build's vectors (prefill_attention.cpp's kWidth): head_dim must be a multiple of it."""
    flags = cpu_flags()
    return 16 if "avx512f" in flags else 8 if "avx2" in flags else 4


@functools.cache
def load() -> None:
    """Build the op if this machine has no build of it yet, then load it; RuntimeError saying why not."""
    build_and_load("prefill_attention.cpp")


@functools.cache
def available() -> bool:
    """Whether the op builds and loads here; the first failure is logged once."""
    return build_and_load_or_warn("prefill_attention.cpp", "prefill attention runs on torch's SDPA")


def takes(q: torch.Tensor) -> bool:
    """Whether the op runs this layer's queries [tokens, heads, head_dim] (then it is built and loaded)."""
    return (q.device.type == "cpu" and q.dtype in DTYPES and q.size(-1) % vector_width() == 0
            and q.stride(-1) == 1 and available())


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int = 0,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(scale * q K^T) V per query head over the keys each query sees. q: [len_q, heads, head_dim], the last
    len_q of the len_k positions k, v: [len_k, kv_heads, head_dim] hold (head_dim contiguous in each); query i
    is position len_k - len_q + i and sees the keys up to its own, only the last `window` of them if window > 0.
    Returns [len_q, heads, head_dim]: out if given (head_dim contiguous), else a new tensor."""
    load()
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype)
    torch.ops.tpengine_prefill.prefill_attention(out, q, k, v, scale, window)
    return out
