"""The CPU platform: the decoder's elementwise ops as C++ ops, linears on packed weights, the dtype a model
runs in and the one its linear weights are kept in (cpu_dtype.py), the rows a forward is padded to and the threads
a rank takes.

The C++ ops (kernels/cpu/fused_ops.cpp, built on first use) each replace several torch ops, each a
dispatch and an allocation, which at decode sizes cost more than the arithmetic. Each function here takes
its C++ op where this machine built it and the tensor suits it (a dtype it takes, rows contiguous), else
runs the torch code (torch_ops.py), which computes the same values.
"""
import ctypes
import logging
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

from tpengine.kernels.cpu import bf16_linear as bf16_kernel
from tpengine.kernels.cpu import fused_ops
from tpengine.kernels.cpu import lora as lora_kernel
from tpengine.kernels.cpu import quant_linear as quant_kernel
from tpengine.platforms import cpu_dtype, torch_ops
from tpengine.platforms.packed import MinimumCorrected, PackedWeight, packed_linear, with_minimums
from tpengine.platforms.packed import embedding_rows  # noqa: F401 (the Platform's: each form gathers its own rows)

logger = logging.getLogger("tpengine")

# activations of a 2048-token forward stay in reused heap memory and in cache; one forward over ~10k
# tokens was ~15% slower (docs/benchmarks.md)
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


def resolve_dtype(dtype: str, hf_config, log: bool = True) -> torch.dtype:
    """float32 for "auto"; a half dtype the CPU cannot compute fast runs as float32 (cpu_dtype.py)."""
    return torch.float32 if dtype == "auto" else cpu_dtype.resolve_cpu_dtype(getattr(torch, dtype), log)


def linear_weight_dtype(dtype: str) -> torch.dtype | None:
    """bfloat16 where a bfloat16 model runs as float32 with its linear weights kept in bfloat16 (cpu_dtype.py)."""
    return None if dtype == "auto" else cpu_dtype.linear_weight_dtype(getattr(torch, dtype))


def set_up_rank(device: torch.device, num_ranks: int) -> None:
    """Ranks on one CPU share its cores: oversubscribed threads only slow every rank down. The cores are the
    ones this process may run on (a data-parallel replica is pinned to its share)."""
    if num_ranks > 1:
        num_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, num_cores // num_ranks))


def release_freed_memory() -> None:
    """Hand the heap memory freed since start-up back to the system: glibc keeps what a load frees (the float copies
    that packing replaced, the packing's temporaries) resident for reuse; measured ~0.7-1.3 GB on the 0.6B shape."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator returns memory its own way
        pass


def row_bucket(num_rows: int) -> int:
    """The rows a CPU forward is padded to: up to 8 exactly (a batch-1 verify row of 4 or 6 drafts runs
    unpadded), then a power of two or 3/4 of one (12, 16, 24, ...). oneDNN builds and keeps a kernel for every
    row count a linear sees (about 0.6 MB each, up to 1,024 of them), so a server whose batches took every size
    grew by hundreds of MB; padding to these sizes keeps the kernels to a few dozen, for at most a third more
    rows (idle ones, in a decode batch: the weights are read once either way)."""
    if num_rows <= 8:
        return num_rows
    power = 1 << (num_rows - 1).bit_length()
    return power * 3 // 4 if num_rows <= power * 3 // 4 else power


# --- the decoder's elementwise ops -----------------------------------------------------------------

def _fused_takes(x: torch.Tensor) -> bool:
    """Whether the C++ ops take x: a dtype they compute, its last dimension contiguous, and built here."""
    return x.dtype in fused_ops.DTYPES and x.stride(-1) == 1 and fused_ops.available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return fused_ops.rms_norm(x, weight, eps) if _fused_takes(x) else torch_ops.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual normed, x + residual); the C++ op writes both in place, into x and residual: the decoder
    hands over tensors it no longer reads."""
    if _fused_takes(x) and residual.is_contiguous() and x.is_contiguous():
        return fused_ops.add_rms_norm_(x, residual, weight, eps)
    return torch_ops.add_rms_norm(x, residual, weight, eps)


def qk_norm_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm, k_norm,
                   cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k each head RMS-normed by q_norm and k_norm (RMSNorms over head_dim; None: no norm), then rotated
    by each token's position; the C++ op does it all in place, in q and k (views of the fresh q/k/v
    projection)."""
    # each module attribute read costs a microsecond or two: the norms' weights are read once
    q_weight, k_weight, eps = (None, None, 0.0) if q_norm is None else (q_norm.weight, k_norm.weight, q_norm.eps)
    if (_fused_takes(q) and k.stride(-1) == 1 and positions.dtype == torch.int64
            and cos_sin_cache.dtype == torch.float32
            # the C++ op takes one eps and norm weights of q's dtype (Gemma's are float32 in any model)
            and (q_weight is None or eps == k_norm.eps and q_weight.dtype == k_weight.dtype == q.dtype)):
        return fused_ops.qk_norm_rotary_(q, k, q_weight, k_weight, eps, positions, cos_sin_cache)
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    return torch_ops.apply_rotary_in_halves(positions, q, k, cos_sin_cache)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return fused_ops.silu_and_mul(x) if _fused_takes(x) else torch_ops.silu_and_mul(x)


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Each token's K/V into its cache slot, skipping slot -1 (padding); the C++ op needs no mask, so no
    host sync."""
    if _fused_takes(k) and v.stride(-1) == 1:
        fused_ops.store_kvcache(k, v, k_cache, v_cache, slot_mapping)
    else:
        torch_ops.store_kvcache_masked(k, v, k_cache, v_cache, slot_mapping)


def moe_experts(x: torch.Tensor, w13, w2, topk_weights: torch.Tensor, topk_ids: torch.Tensor, act_and_mul=None,
                w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped by expert in torch; torch's SiLU between the experts' matmuls unless act_and_mul is given: the C++
    op gives torch's bits only at torch's vector width. w13, w2: the stacked float weights, or
    pack_quantized_experts' lists of packs, multiplied by linear()."""
    return torch_ops.grouped_experts(x, w13, w2, topk_weights, topk_ids, act_and_mul or torch_ops.silu_and_mul,
                                     linear=packed_linear if isinstance(w13, list) else F.linear,
                                     w13_bias=w13_bias, w2_bias=w2_bias)


def lora_add(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scales: torch.Tensor,
             slots: torch.Tensor) -> None:
    """The C++ op where this machine built it (rows of one slot in a row as a segment: matmuls for a prefill chunk,
    loops for scattered decode rows), else the torch code, which takes every slot's product for every row."""
    if y.dtype in lora_kernel.DTYPES and lora_kernel.available():
        lora_kernel.lora_add(y, x, lora_a, lora_b, scales, slots)
    else:
        torch_ops.lora_add_torch(y, x, lora_a, lora_b, scales, slots)


# --- linears on packed weights ---------------------------------------------------------------------

# oneDNN packs a weight for a typical number of rows; any number of rows runs on the packed copy
PREPACK_ROWS_HINT = 64

# dtypes oneDNN multiplies on packed weights; a half dtype reaches a CPU model only where the CPU has
# the instructions for it (cpu_dtype.py), else the model runs in float32
PACKED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Bf16Blocks(NamedTuple):
    """A bfloat16 weight packed for tpengine's bfloat16 linear (kernels/cpu/bf16_linear.cpp)."""
    blocks: torch.Tensor
    out_features: int

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return bf16_kernel.bf16_linear(x, self.blocks, self.out_features, bias)

    def rows(self, token_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return bf16_kernel.packed_rows(self.blocks, token_ids.flatten()).view(*token_ids.shape, -1).to(dtype)


def pack_linear_weight(weight: torch.Tensor, weight_dtype: torch.dtype | None = None
                       ) -> torch.Tensor | Bf16Blocks | None:
    """A packed copy of an [out, in] weight that linear() multiplies faster, or None.

    bfloat16 on a CPU with AVX512-BF16: blocks for tpengine's kernel, ~2-3x oneDNN's speed at decode
    batch sizes (no per-call dispatch) and on par with it for a prefill. Otherwise oneDNN's blocked copy:
    without it each matmul repacks the weight first, at decode batch sizes as costly as the product; the
    packed copy runs about 2-3.5x faster (docs/benchmarks.md).

    weight_dtype (linear_weight_dtype's bfloat16): a weight (loaded in bfloat16, or float32) kept as bfloat16 blocks
    that the same kernel multiplies by float32 rows, 1.7-2.5x oneDNN's float32 speed at decode batch sizes and ~0.9x
    for a prefill; None where this weight cannot be (an odd number of in-features).
    """
    if weight_dtype is not None:
        if (weight_dtype == torch.bfloat16 and weight.dtype in (torch.float32, torch.bfloat16)
                and weight.size(1) % 2 == 0 and bf16_kernel.float_rows_available()):
            return Bf16Blocks(bf16_kernel.pack_weight(weight.detach().to(torch.bfloat16)), weight.size(0))
        return None
    if weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES:
        return None
    if weight.dtype == torch.bfloat16 and weight.size(1) % 2 == 0 and bf16_kernel.available():
        return Bf16Blocks(bf16_kernel.pack_weight(weight.detach()), weight.size(0))
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PREPACK_ROWS_HINT)
    except RuntimeError:  # a oneDNN build or CPU that cannot pack this weight: the plain matmul still runs
        return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed_weight: torch.Tensor | PackedWeight | None) -> torch.Tensor:
    """x @ weight^T (+ bias), on packed_weight where prepack made one: oneDNN's copy is a plain tensor, checked
    first (the float model's decode path), every other form multiplies itself (packed.py)."""
    if packed_weight is None:
        return F.linear(x, weight, bias)
    if type(packed_weight) is torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")
    return packed_weight.matmul(x, bias)


# --- quantized weights -----------------------------------------------------------------------------

# a float checkpoint quantized at load quantizes each linear's input per token too: the integer dot products
# are what make int8/int4 weights faster than float32 here (docs/benchmarks.md); float inputs are not
ONLINE_QUANTIZATION_ACTIVATION = "int8"


def runs_fp8_linears(device: torch.device) -> bool:
    """No FP8 matmul on the CPU: an FP8 checkpoint is read into float weights at load."""
    return False


class QuantizedLinear(NamedTuple):
    """A quantized weight packed for the C++ int8/int4 linear (kernels/cpu/quant_linear.cpp)."""
    packed: quant_kernel.PackedQuantWeight
    input_order: torch.Tensor | None  # act order: the input column each packed column multiplies

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.input_order is not None:
            x = x.index_select(-1, self.input_order)
        return quant_kernel.quant_linear(x, self.packed, bias)

    def rows(self, token_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        assert self.input_order is None, "an embedding table has no act order"
        return quant_kernel.dequantize_rows(self.packed, token_ids.flatten()).view(*token_ids.shape, -1).to(dtype)


def pack_quantized_weight(quantized, dtype: torch.dtype
                          ) -> QuantizedLinear | MinimumCorrected | torch_ops.DequantizedWeight:
    """A QuantizedWeight as linear() multiplies it: packed for the C++ linear where it is built and takes the
    weight (its minimums, if any, subtracted around it: packed.py's MinimumCorrected), else its float value."""
    if dtype in (torch.float32, torch.bfloat16) and quant_kernel.available():
        contiguous, input_order = quantized.with_contiguous_groups()
        try:
            return with_minimums(quantized, QuantizedLinear(quant_kernel.pack(
                contiguous.qweight, contiguous.scales, contiguous.zeros, contiguous.bits, contiguous.group_size,
                contiguous.activation), input_order))
        except ValueError as error:  # a group size or zero point the kernel does not take
            logger.warning("a quantized linear runs on its float weights: %s", error)
    return torch_ops.dequantized_weight(quantized, dtype)


def pack_float_experts(w13: torch.Tensor, w2: torch.Tensor) -> tuple[list, list] | None:
    """bfloat16 experts as tpengine's bfloat16 kernel's blocks, one pack per expert and projection, where the CPU has
    AVX512-BF16: ~4x oneDNN's matmul at decode sizes, which grouped_experts otherwise calls per expert; float32 and
    float16 experts stay as they are (their products then keep torch's bits)."""
    if w13.dtype != torch.bfloat16 or w13.size(-1) % 2 or w2.size(-1) % 2 or not bf16_kernel.available():
        return None
    return ([Bf16Blocks(bf16_kernel.pack_weight(w.contiguous()), w.size(0)) for w in w13],
            [Bf16Blocks(bf16_kernel.pack_weight(w.contiguous()), w.size(0)) for w in w2])


def pack_quantized_experts(w13: list, w2: list, dtype: torch.dtype) -> tuple[list, list]:
    """Each expert's gate/up (joined) and down QuantizedWeights, packed one by one for moe_experts."""
    return [pack_quantized_weight(w, dtype) for w in w13], [pack_quantized_weight(w, dtype) for w in w2]
