"""The CUDA platform: the decoder's small elementwise ops compiled by torch.compile (each a kernel or two
instead of several), Triton's fused experts and int4/int8 weight-only GEMM, and the dtype a model runs in.

The CPU runs the same torch code as written (torch_ops.py): compiled, these ops were faster on 2 CPU cores
at prefill sizes, but the first compile costs 1-14 s, which would dominate short CPU runs, and the fused
RMSNorm rounds differently (docs/benchmarks.md).
"""
import functools
import importlib.util
import logging

import torch

from tpengine.platforms import cuda_fp8, torch_ops
from tpengine.platforms.packed import embedding_rows, linear  # noqa: F401 (the Platform's: each form multiplies itself)
from tpengine.platforms.packed import packed_linear, with_minimums
from tpengine.quantization.fp8 import Fp8Weight, quantize_fp8_activation

logger = logging.getLogger("tpengine")

DEFAULT_MAX_NUM_BATCHED_TOKENS = 16384
HAS_TRITON = importlib.util.find_spec("triton") is not None


def compiled(fn):
    """torch.compile(fn), built on first use.

    Should compiling ever fail here, fn runs eagerly from then on, with a warning: compiling is only
    an optimisation.
    """
    compiled_fn = None

    @functools.wraps(fn)
    def run(*args):
        nonlocal compiled_fn
        if compiled_fn is False:
            return fn(*args)
        if compiled_fn is None:
            # shapes left to dynamo: the token dimension turns dynamic after the second size it sees
            compiled_fn = torch.compile(fn)
        try:
            return compiled_fn(*args)
        except Exception as e:  # any compiler failure: the eager function is the fallback
            logger.warning("torch.compile of %s failed (%s: %s); running it eagerly", fn.__name__,
                           type(e).__name__, e)
            compiled_fn = False
            return fn(*args)

    return run


def compiled_on_cuda(fn):
    """fn itself for CPU tensors, compiled(fn) when the first argument is on CUDA: for code that learns its
    device only from the tensors it is handed (the sampler)."""
    on_cuda = compiled(fn)

    @functools.wraps(fn)
    def dispatch(x: torch.Tensor, *args):
        return on_cuda(x, *args) if x.is_cuda else fn(x, *args)

    return dispatch


def resolve_dtype(dtype: str, hf_config, log: bool = True) -> torch.dtype:
    """The dtype asked for; "auto": the checkpoint's, else bfloat16."""
    if dtype == "auto":
        checkpoint_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(checkpoint_dtype, str):
            checkpoint_dtype = getattr(torch, checkpoint_dtype)
        return checkpoint_dtype or torch.bfloat16
    return getattr(torch, dtype)


def linear_weight_dtype(dtype: str) -> None:
    """Linear weights are in the dtype the model runs in."""
    return None


def release_freed_memory() -> None:
    """Nothing: the load's host memory is freed as it goes, and torch's caching allocator keeps the GPU's."""


def set_up_rank(device: torch.device, num_ranks: int) -> None:
    """This rank's GPU becomes the current device."""
    torch.cuda.set_device(device)


def row_bucket(num_rows: int) -> int:
    """A forward runs at its own size (a decode step in a CUDA graph is padded to the graph's batch size)."""
    return num_rows


# --- the decoder's elementwise ops -----------------------------------------------------------------

rms_norm = compiled(torch_ops.rms_norm)
add_rms_norm = compiled(torch_ops.add_rms_norm)
silu_and_mul = compiled(torch_ops.silu_and_mul)
apply_rotary = compiled(torch_ops.apply_rotary_pointwise)


def qk_norm_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm, k_norm,
                   cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k each head RMS-normed by q_norm and k_norm (RMSNorms over head_dim; None: no norm), then rotated
    by each token's position."""
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    return apply_rotary(positions, q, k, cos_sin_cache)


def moe_experts(x: torch.Tensor, w13, w2, topk_weights: torch.Tensor, topk_ids: torch.Tensor, act_and_mul=None,
                w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Triton's fused experts where Triton is installed (no host sync, so decode stays graph-capturable),
    else grouped by expert in torch. w13, w2: the stacked float weights, or what pack_quantized_experts made of
    quantized ones (stacked QuantizedExperts: fused; lists of packs: grouped by expert, through linear()).
    act_and_mul: silu(gate) * up unless given. The kernel has no biases: the gate/up bias is added to its rows
    (one per (token, k) pair, in pair order) before act_and_mul, the down bias, weighted, to its sum."""
    act_and_mul = act_and_mul or silu_and_mul
    if isinstance(w13, list):
        return torch_ops.grouped_experts(x, w13, w2, topk_weights, topk_ids, act_and_mul, linear=packed_linear,
                                         w13_bias=w13_bias, w2_bias=w2_bias)
    if not HAS_TRITON:
        return torch_ops.grouped_experts(x, w13, w2, topk_weights, topk_ids, act_and_mul, w13_bias=w13_bias,
                                         w2_bias=w2_bias)
    from tpengine.kernels.triton.fused_moe import fused_experts
    activation = act_and_mul
    if w13_bias is not None:
        pair_bias = w13_bias[topk_ids.flatten()]
        activation = lambda gate_up: act_and_mul(gate_up + pair_bias)  # noqa: E731
    out = fused_experts(x, w13, w2, topk_weights, topk_ids, activation)
    if w2_bias is not None:
        out = out + (topk_weights.unsqueeze(-1) * w2_bias[topk_ids]).sum(dim=1)
    return out


def lora_add(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scales: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Triton's kernel where Triton is installed (one program per row and column block, no host sync: decode stays
    graph-capturable), else the torch code."""
    if HAS_TRITON:
        from tpengine.kernels.triton.lora import lora_add as triton_lora_add
        triton_lora_add(y, x, lora_a, lora_b, scales, slots)
    else:
        torch_ops.lora_add_torch(y, x, lora_a, lora_b, scales, slots)


# --- linears: linear and embedding_rows are packed.py's, each packed form multiplying itself ----------

def pack_linear_weight(weight: torch.Tensor, weight_dtype: torch.dtype | None = None) -> None:
    """No packed copy: cuBLAS reads the plain weight (and linear_weight_dtype asks for no other dtype)."""
    return None


# --- quantized weights -----------------------------------------------------------------------------

# weight-only: a decode step is bound by the weight's bytes, and float inputs need no quantizing per call
ONLINE_QUANTIZATION_ACTIVATION = "float"


def pack_quantized_weight(quantized, dtype: torch.dtype):
    """A QuantizedWeight as linear() multiplies it: packed for Triton's GEMM (cuda_quant.py) where it takes the
    weight (its minimums, if any, subtracted around it: packed.py's MinimumCorrected), an FP8 one for cuda_fp8.py's
    GEMMs, else its float value in dtype."""
    if isinstance(quantized, Fp8Weight):
        return cuda_fp8.pack_fp8_weight(quantized, dtype, quantize_fp8_activation_compiled)
    if HAS_TRITON and dtype in (torch.float16, torch.bfloat16, torch.float32):
        from tpengine.platforms.cuda_quant import pack_quant_weight
        try:
            return with_minimums(quantized, pack_quant_weight(quantized))
        except ValueError as error:  # a group size or zero point the kernel does not take
            logger.warning("a quantized linear runs on its float weights: %s", error)
    return torch_ops.dequantized_weight(quantized, dtype)


def pack_float_experts(w13: torch.Tensor, w2: torch.Tensor) -> None:
    """Float experts stay stacked: Triton's fused kernel reads them so."""
    return None


def pack_quantized_experts(w13: list, w2: list, dtype: torch.dtype):
    """Each expert's gate/up (joined) and down QuantizedWeights as moe_experts multiplies them: packed for
    Triton's GEMM and stacked once for the fused experts kernel; where it does not take them (W8A8, act order,
    no Triton), each expert's pack in a list, run grouped by expert with a host sync (not graph-capturable)."""
    packed = ([pack_quantized_weight(w, dtype) for w in w13], [pack_quantized_weight(w, dtype) for w in w2])
    if not HAS_TRITON:
        return packed
    from tpengine.kernels.triton.fused_moe import stack_quantized_experts
    from tpengine.platforms.cuda_quant import TritonQuantLinear
    if not all(type(p) is TritonQuantLinear for p in packed[0] + packed[1]):
        _log_grouped_experts("the Triton GEMM does not take every expert's weight")
        return packed
    try:
        return stack_quantized_experts(packed[0]), stack_quantized_experts(packed[1])
    except ValueError as error:
        _log_grouped_experts(str(error))
        return packed


@functools.cache  # once per reason, not once per layer
def _log_grouped_experts(reason: str) -> None:
    logger.info("quantized MoE experts run grouped by expert in torch, not in the fused kernel: %s", reason)


# --- FP8 W8A8 (cuda_fp8.py): sm_89+ only ---------------------------------------------------------

quantize_fp8_activation_compiled = compiled(quantize_fp8_activation)


def runs_fp8_linears(device: torch.device) -> bool:
    """FP8 tensor cores (sm_89+) and Triton for the block kernel; below, FP8 checkpoints load as float weights
    (the runner's log line says so) and quantization="fp8" is refused."""
    return HAS_TRITON and cuda_fp8.runs_fp8(torch.cuda.get_device_capability(device))
