"""The CUDA platform: the decoder's small elementwise ops compiled by torch.compile (each a kernel or two
instead of several), Triton's fused experts, and the dtype a model runs in.

The CPU runs the same torch code as written (torch_ops.py): compiled, these ops were faster on 2 CPU cores
at prefill sizes, but the first compile costs 1-14 s, which would dominate short CPU runs, and the fused
RMSNorm rounds differently (docs/benchmarks.md).
"""
import functools
import importlib.util
import logging

import torch
import torch.nn.functional as F

from tpengine.platforms import cuda_fp8, torch_ops
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


def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, act_and_mul=None, w13_bias: torch.Tensor | None = None,
                w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Triton's fused experts where Triton is installed (no host sync, so decode stays graph-capturable),
    else grouped by expert in torch. act_and_mul: silu(gate) * up unless given. The kernel has no biases: the
    gate/up bias is added to its rows (one per (token, k) pair, in pair order) before act_and_mul, the down
    bias, weighted, to its sum."""
    act_and_mul = act_and_mul or silu_and_mul
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


# --- linears -------------------------------------------------------------------------------------

def pack_linear_weight(weight: torch.Tensor) -> None:
    """No packed copy: cuBLAS reads the plain weight."""
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed_weight: torch_ops.DequantizedWeight | cuda_fp8.Fp8Linear | None) -> torch.Tensor:
    if type(packed_weight) is cuda_fp8.Fp8Linear:
        return cuda_fp8.fp8_linear(x, packed_weight, bias, quantize_fp8_activation_compiled)
    if packed_weight is not None:
        return torch_ops.dequantized_linear(x, packed_weight, bias)
    return F.linear(x, weight, bias)


# --- quantized weights: no CUDA kernel yet, so their float value -----------------------------------

ONLINE_QUANTIZATION_ACTIVATION = "float"

def pack_quantized_weight(quantized, dtype: torch.dtype) -> torch_ops.DequantizedWeight | cuda_fp8.Fp8Linear:
    if isinstance(quantized, Fp8Weight):
        return cuda_fp8.pack_fp8_weight(quantized, dtype)
    return torch_ops.dequantized_weight(quantized, dtype)


# --- FP8 W8A8 (cuda_fp8.py): sm_89+ only ---------------------------------------------------------

quantize_fp8_activation_compiled = compiled(quantize_fp8_activation)


def runs_fp8_linears(device: torch.device) -> bool:
    """FP8 tensor cores (sm_89+) and Triton for the block kernel; below, FP8 checkpoints load as float weights
    (the runner's log line says so) and quantization="fp8" is refused."""
    return HAS_TRITON and cuda_fp8.runs_fp8(torch.cuda.get_device_capability(device))


def embedding_rows(token_ids: torch.Tensor, packed_weight: torch_ops.DequantizedWeight,
                   dtype: torch.dtype) -> torch.Tensor:
    return F.embedding(token_ids, packed_weight.weight).to(dtype)
