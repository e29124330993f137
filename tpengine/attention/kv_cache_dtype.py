"""The KV cache's element type: the model's dtype, or FP8 e4m3 with a per-tensor scale for K and for V per layer.

An FP8 cache holds e4m3(clamp(x / scale)) and is read back as float32(fp8) * scale, then rounded to the query's
dtype (vLLM's rule); each layer's k_scale and v_scale come from the checkpoint when it has them, else 1.0.
The torch code here is the reference the Triton kernels match bit for bit in the store.
"""
import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448: e4m3 has no infinity, and a cast past it gives NaN, so values are clamped


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensor's dtype for EngineConfig.kv_cache_dtype, validated there: every name but "auto" is e4m3."""
    return model_dtype if kv_cache_dtype == "auto" else FP8


def is_fp8(dtype: torch.dtype | None) -> bool:
    return dtype == FP8


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3(x / scale), in float32, clamped to e4m3's range; scale: a float32 tensor of one element."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows as the attention reads them: float32(x) * scale in dtype; rows of a model-dtype cache as they are."""
    if not is_fp8(x.dtype):
        return x
    return (x.float() * scale).to(dtype)
