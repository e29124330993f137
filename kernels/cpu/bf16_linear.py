"""The C++ linear on bfloat16 weights (bf16_linear.cpp), built on first use by kernels/cpu/build.py and loaded as
the torch op `torch.ops.tpengine_cpu.bf16_linear`, and the weight packing it reads. Its rows are bfloat16 on
AVX512-BF16 CPUs, or float32 on AVX2 ones (a bfloat16 model's activations where the CPU cannot compute bfloat16)."""
import functools

import torch
import torch.nn.functional as F

from tpengine.kernels.cpu.build import build_and_load, cpu_flags, has_compiler
from tpengine.kernels.cpu.huge_pages import on_huge_pages

BLOCK_OUT = 64  # output features per packed block (bf16_linear.cpp)


@functools.cache
def _loaded() -> bool:
    if not has_compiler():
        return False
    try:
        build_and_load("bf16_linear.cpp")
    except RuntimeError:
        return False
    return True


def available() -> bool:
    """Whether this CPU has AVX512-BF16 (the op's instructions for bfloat16 rows) and the op builds and loads here."""
    return {"avx512_bf16", "avx512bw"} <= cpu_flags() and _loaded()


def float_rows_available() -> bool:
    """Whether this CPU has AVX2 and FMA (the op's instructions for float32 rows) and the op builds and loads here."""
    return {"avx2", "fma"} <= cpu_flags() and _loaded()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] bfloat16 (in even) -> [ceil(out / 64), in / 2, 64, 2]: zero rows pad the last block. On huge pages."""
    out_features, in_features = weight.shape
    padded = F.pad(weight, (0, 0, 0, -out_features % BLOCK_OUT))
    return on_huge_pages(padded.view(-1, BLOCK_OUT, in_features // 2, 2).permute(0, 2, 1, 3))


def packed_rows(packed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows [n] of the [out, in] weight pack_weight packed, as [n, in] float32 (exactly): an embedding table's
    lookups; needs the op loaded (available() or float_rows_available())."""
    return torch.ops.tpengine_cpu.bf16_packed_rows(packed, rows)


def bf16_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ W^T (+ bias) from pack_weight(W), accumulated in float32: bfloat16 x (needs available(),
    rounds once to bfloat16) or float32 x (needs float_rows_available(), float32 out)."""
    return torch.ops.tpengine_cpu.bf16_linear(x, packed, out_features, bias)
