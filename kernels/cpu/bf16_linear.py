"""The C++ bfloat16 linear on AVX512-BF16 CPUs (bf16_linear.cpp), built on first use by kernels/cpu/build.py
and loaded as the torch op `torch.ops.tpengine_cpu.bf16_linear`, and the weight packing it reads."""
import functools

import torch
import torch.nn.functional as F

from tpengine.kernels.cpu.build import build_and_load, cpu_flags, has_compiler

BLOCK_OUT = 64  # output features per packed block (bf16_linear.cpp)


@functools.cache
def available() -> bool:
    """Whether this CPU has AVX512-BF16 (the op's instructions) and the op builds and loads here."""
    if not {"avx512_bf16", "avx512bw"} <= cpu_flags() or not has_compiler():
        return False
    try:
        build_and_load("bf16_linear.cpp")
    except RuntimeError:
        return False
    return True


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] bfloat16 (in even) -> [ceil(out / 64), in / 2, 64, 2]: zero rows pad the last block."""
    out_features, in_features = weight.shape
    padded = F.pad(weight, (0, 0, 0, -out_features % BLOCK_OUT))
    return padded.view(-1, BLOCK_OUT, in_features // 2, 2).permute(0, 2, 1, 3).contiguous()


def bf16_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ W^T (+ bias) from pack_weight(W), accumulated in float32; needs available()."""
    return torch.ops.tpengine_cpu.bf16_linear(x, packed, out_features, bias)
