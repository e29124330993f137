"""Half precision on the CPU: bfloat16 / float16 run as asked where the CPU has the instructions for fast
kernels (tpengine's AVX512-BF16 linear, oneDNN's bf16/fp16 matmuls); elsewhere the model runs in float32,
and one log line says why.

Without the instructions a half-precision matmul converts every weight on every call: measured on an
AVX-512 CPU without avx512_fp16, float16 weights ran a batch-1 linear ~7x slower upcast per matmul and
up to ~10x slower at batch 16 through torch's own float16 kernel than float32 weights converted once at
load (docs/benchmarks.md), so the fallback computes in float32. A bfloat16 model keeps its linear weights
(and embedding table) in bfloat16 where the CPU has AVX2 and FMA: tpengine's linear widens them to float32 in
registers, exactly, as it multiplies, so a decode step reads half the bytes of float32 weights.
"""
import logging
import platform

import torch

from tpengine.kernels.cpu import bf16_linear as bf16_kernel
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
        weights = ("; its linear weights stay bfloat16, widened to float32 as they are multiplied"
                   if linear_weight_dtype(dtype) is not None else
                   ", and converting its weights on every matmul is several times slower than converting them once")
        logger.info("dtype %s runs as float32 on this CPU: %s%s", str(dtype).removeprefix("torch."), problem, weights)
    return torch.float32


def linear_weight_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a model asked for in dtype keeps its linear weights in while it runs in float32: bfloat16 where the
    CPU has tpengine's AVX2 linear on bfloat16 weights (kernels/cpu/bf16_linear.cpp); else None: the weights are
    the model's dtype."""
    if dtype != torch.bfloat16 or resolve_cpu_dtype(dtype, log=False) == dtype:
        return None
    return dtype if {"avx2", "fma"} <= cpu_flags() and bf16_kernel.float_rows_available() else None
