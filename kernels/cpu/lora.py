"""The CPU LoRA add (lora.cpp), built on first use by kernels/cpu/build.py and loaded as the torch op
`torch.ops.tpengine_lora.lora_add`: y[t] += scales[s] * (x[t] @ lora_a[s]) @ lora_b[s] for each row t of slot
s = slots[t] >= 0, in place, rows of one slot in a row grouped into a segment (SGMV).

Callers ask `available()` first: without a compiler the CPU platform (tpengine/platforms/cpu.py) runs
torch_ops.lora_add_torch, which computes the same values.
"""
import functools

import torch

from tpengine.kernels.cpu.build import build_and_load_or_warn

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# A segment of at least this many rows a thread runs as two matmuls, shorter ones in the hand loops, which spread
# over the threads better (the matmul path's float32 copies do not). K = N = 1024, R = 16 on 2 EPYC cores
# (AVX512-BF16), best of 25, µs, bfloat16 (float32), loops / matmuls:
#   1 thread:  1 row 5.3 (4.2) / 17 (9.5); 8 rows 29 (15) / 25 (16); 16 rows 46 (27) / 33 (21);
#              64 rows 181 (103) / 103 (66)
#   2 threads: 1 row 5.3 (4.1) / 17 (8.9); 8 rows 15 (13) / 40 (22); 32 rows 52 (32) / 63 (35);
#              64 rows 96 (53) / 88 (55)
# and 64 decode rows of scattered slots, 2 threads: 99 (55) in loops, 901 (405) as 64 one-row matmuls
MM_MIN_ROWS_PER_THREAD = 16


@functools.cache
def available() -> bool:
    """Whether the op is built and loaded here; the first failure is logged once."""
    return build_and_load_or_warn("lora.cpp", "the CPU adds LoRA deltas with torch")


def lora_add(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scales: torch.Tensor,
             slots: torch.Tensor, mm_min_rows: int | None = None) -> None:
    """y [T, N] += each row's LoRA delta, in place; x [T, K], lora_a [S, K, R], lora_b [S, R, N] of y's dtype,
    scales float32 [S], slots int64 [T] (-1: no adapter). Segments of mm_min_rows rows or more run as matmuls
    (None: MM_MIN_ROWS_PER_THREAD for each of torch's threads). Needs available()."""
    if mm_min_rows is None:
        mm_min_rows = MM_MIN_ROWS_PER_THREAD * torch.get_num_threads()
    torch.ops.tpengine_lora.lora_add(y, x, lora_a, lora_b, scales, slots, mm_min_rows)
