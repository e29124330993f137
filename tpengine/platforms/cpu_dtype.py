"""Half precision on the CPU: bfloat16 / float16 run as asked where the CPU has the instructions for fast
kernels (tpengine's AVX512-BF16 linear, oneDNN's bf16/fp16 matmuls); elsewhere the model runs in float32,
and one log line says why.

Without the instructions a half-precision matmul converts every weight on every call: measured on an
AVX-512 CPU without avx512_fp16, float16 weights ran a batch-1 linear ~7x slower upcast per matmul and
up to ~10x slower at batch 16 through torch's own float16 kernel than float32 weights converted once at
load (docs/benchmarks.md), so the fallback converts once, at load, and computes in float32.
"""
import logging
import platform

import torch

from tpengine.kernels.cpu.build import cpu_flags

logger = logging.getLogger("tpengine")

# CPU flags (/proc/cpuinfo on x86) of instructions that compute in the dtype: any one of them will do
NATIVE_FLAGS = {
    torch.bfloat16: ("avx512_bf16", "amx_bf16"),
    torch.float16: ("avx512_fp16", "amx_fp16"),
}


def onednn_supports(dtype: torch.dtype) -> bool:
    """Whether this torch's oneDNN runs matmuls in dtype on this CPU (emulated or not)."""
    if not torch.backends.mkldnn.is_available():
        return False
    check = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}[dtype]
    return hasattr(torch.ops.mkldnn, check) and getattr(torch.ops.mkldnn, check)()


def half_precision_problem(dtype: torch.dtype, flags: frozenset[str], onednn: bool,
                           machine: str = platform.machine()) -> str | None:
    """Why this CPU cannot compute dtype with fast kernels, or None where it can."""
    name = str(dtype).removeprefix("torch.")
    if not onednn:
        return f"this torch's oneDNN runs no {name} matmuls on this CPU"
    if machine in ("x86_64", "AMD64") and not flags & set(NATIVE_FLAGS[dtype]):
        return f"the CPU has none of {', '.join(NATIVE_FLAGS[dtype])}"
    return None


def resolve_cpu_dtype(dtype: torch.dtype, log: bool = True) -> torch.dtype:
    """The dtype a CPU model runs in when dtype is asked for: itself, or float32 where the CPU lacks the
    instructions for it (weights converted once at load, activations and the KV cache in float32)."""
    if dtype not in NATIVE_FLAGS:
        return dtype
    problem = half_precision_problem(dtype, cpu_flags(), onednn_supports(dtype))
    if problem is None:
        return dtype
    if log:
        logger.info("dtype %s runs as float32 on this CPU: %s, and converting its weights on every matmul is "
                    "several times slower than converting them once at load", str(dtype).removeprefix("torch."),
                    problem)
    return torch.float32
