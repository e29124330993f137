"""What each device does its own way, one module per device: cpu.py (C++ elementwise ops with their torch
fallbacks, linears on packed weights, half precision only where the CPU computes it, padded row counts,
threads per rank) and cuda.py (the elementwise ops compiled, Triton's fused experts). torch_ops.py holds
the torch code both start from.

A layer asks once, when it is built, for the platform of the device the model is built on
(`current_platform`) and keeps the functions it calls as attributes: a forward never asks which device
it runs on. The runner asks `platform_for(device)` for its settings. The modules themselves are the
platform objects; `Platform` lists what each provides. A weight packed for a kernel multiplies itself
(packed.py's PackedWeight), so linear and embedding_rows are the same call on every platform.
"""
from typing import Protocol

import torch


class Platform(Protocol):
    DEFAULT_MAX_NUM_BATCHED_TOKENS: int  # max_num_batched_tokens when the setting is None
    ONLINE_QUANTIZATION_ACTIVATION: str  # how quantization="int8"|"int4" linears take their input: "float" or "int8"

    # --- the runner's, once per rank ---

    def resolve_dtype(self, dtype: str, hf_config, log: bool = True) -> torch.dtype:
        """The dtype a model runs in when EngineConfig.dtype is `dtype` ("auto", "bfloat16", ...)."""

    def linear_weight_dtype(self, dtype: str) -> torch.dtype | None:
        """The dtype linear weights are kept in when EngineConfig.dtype is `dtype`, where it is not the one the model
        runs in (a bfloat16 model running as float32 on a CPU); None: the model's."""

    def release_freed_memory(self) -> None:
        """After loading: hand the host memory the load freed back to the system."""

    def set_up_rank(self, device: torch.device, num_ranks: int) -> None:
        """Ready this process to compute on device as one of num_ranks ranks of an engine."""

    def row_bucket(self, num_rows: int) -> int:
        """The rows a forward of num_rows rows is padded to."""

    def runs_fp8_linears(self, device: torch.device) -> bool:
        """Whether linears multiply FP8 (Fp8Weight) here; where not, FP8 checkpoints load as float weights."""

    # --- the layers', picked when each is built ---

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual normed, x + residual), possibly written into x and residual."""

    def qk_norm_rotary(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm, k_norm,
                       cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor: ...

    def moe_experts(self, x: torch.Tensor, w13, w2, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    act_and_mul=None, w13_bias: torch.Tensor | None = None,
                    w2_bias: torch.Tensor | None = None) -> torch.Tensor:
        """torch_ops.grouped_experts' sum, however the platform computes it; act_and_mul None: silu(gate) * up.
        w13, w2: the stacked float weights, or what pack_quantized_experts made of quantized ones."""

    def lora_add(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 scales: torch.Tensor, slots: torch.Tensor) -> None:
        """y[t] += scales[s] * (x[t] @ lora_a[s]) @ lora_b[s] for each row t of slot s = slots[t] >= 0, in place, in
        float32 and rounded once (torch_ops.lora_add_torch's values). y [T, N] and x [T, K] with contiguous rows,
        lora_a [S, K, R] and lora_b [S, R, N] contiguous, all of one dtype; scales float32 [S], slots int64 [T]
        (-1: no adapter, the row left alone)."""

    def pack_linear_weight(self, weight: torch.Tensor, weight_dtype: torch.dtype | None = None):
        """After loading: a copy of an [out, in] weight that linear() multiplies faster, or None. weight_dtype
        (linear_weight_dtype's): the copy keeps the weights in it, and embedding_rows reads it too; None if this
        weight cannot be."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               packed_weight) -> torch.Tensor:
        """x @ weight^T (+ bias), on packed_weight where there is one (then weight may be empty): each packed form
        multiplies itself (packed.py's PackedWeight.matmul)."""

    def pack_quantized_weight(self, quantized, dtype: torch.dtype):
        """After loading: a QuantizedWeight or Fp8Weight (tpengine/quantization) as a PackedWeight (packed.py) of
        the platform's kernel; on a platform without a kernel for it, its float value in dtype (DequantizedWeight)."""

    def pack_quantized_experts(self, w13: list, w2: list, dtype: torch.dtype):
        """After loading: each expert's gate/up (joined) and down QuantizedWeights, as moe_experts takes them."""

    def pack_float_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> tuple[list, list] | None:
        """After loading: float experts ([experts, out, in] each) as lists of packs that moe_experts multiplies
        faster, or None to multiply them as they are."""

    def embedding_rows(self, token_ids: torch.Tensor, packed_weight, dtype: torch.dtype) -> torch.Tensor:
        """Rows of an embedding table stored as pack_quantized_weight made it, in dtype."""


def platform_for(device: torch.device) -> Platform:
    """The platform module of a device: tpengine.platforms.cpu or tpengine.platforms.cuda."""
    if device.type == "cpu":
        from tpengine.platforms import cpu
        return cpu
    if device.type == "cuda":
        from tpengine.platforms import cuda
        return cuda
    raise ValueError(f"tpengine runs on cpu or cuda devices, not {device.type}")


def current_platform() -> Platform:
    """The platform of the device a model is being built on (torch's default device: the runner builds
    inside `with torch.device(...)`), which each layer reads in its __init__."""
    return platform_for(torch.get_default_device())
