"""The fused elementwise ops of the CPU decoder (fused_ops.cpp), built on first use by kernels/cpu/build.py
and loaded as torch ops `torch.ops.tpengine_fused.*`.

Each takes float32, bfloat16 or float16 (DTYPES) and computes in float32, rounding where transformers
rounds. Callers ask `available()` first: without a compiler the CPU platform (tpengine/platforms/cpu.py)
runs the torch code, which computes the same values.
"""
import functools

import torch

from tpengine.kernels.cpu.build import build_and_load, build_and_load_or_warn

# transformers rounds each product and sum of these ops on its own: no FMA may merge them
EXTRA_FLAGS = ("-ffp-contract=off",)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def load() -> None:
    """Build the ops if this machine has no build of them yet, then load them; RuntimeError saying why not."""
    build_and_load("fused_ops.cpp", EXTRA_FLAGS)


@functools.cache
def available() -> bool:
    """Whether the ops are built and loaded here; the first failure is logged once."""
    return build_and_load_or_warn("fused_ops.cpp", "the CPU runs their torch code", EXTRA_FLAGS)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dimension] (a view where it can be)."""
    return x if x.dim() == 2 else x.reshape(-1, x.size(-1))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rms_normed(x) over the last dimension, into a new tensor."""
    load()
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype)
    torch.ops.tpengine_fused.rms_norm(out, rows, weight, eps)
    return out if x.dim() == 2 else out.view(x.shape)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x, then x = weight * rms_normed(residual): both in place; returns (x, residual)."""
    load()
    torch.ops.tpengine_fused.add_rms_norm_(_rows(x), _rows(residual), weight, eps)
    return x, residual


def qk_norm_rotary_(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                    eps: float, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim], in place: each head RMS-normed
    (when the weights are given), then rotated by its token's position; returns (q, k)."""
    load()
    torch.ops.tpengine_fused.qk_norm_rotary_(q, k, q_weight, k_weight, eps, positions, cos_sin_cache)
    return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] along the last dimension."""
    load()
    rows = _rows(x)
    out = torch.empty(rows.size(0), rows.size(1) // 2, dtype=x.dtype)
    torch.ops.tpengine_fused.silu_and_mul(out, rows)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out.size(1))


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Each token's K/V into its cache slot, skipping slot -1 (padding)."""
    load()
    torch.ops.tpengine_fused.store_kvcache(k, v, k_cache, v_cache, slot_mapping)


def exp_isa() -> str:
    """The vector instructions the SiLU's exp was built for: avx512, avx2 or scalar."""
    load()
    return torch.ops.tpengine_fused.exp_isa()
