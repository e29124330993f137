"""FP8 W8A8 linears on CUDA (sm_89+): an Fp8Weight packed once after loading, its input quantized to e4m3 as
it arrives, then one FP8 GEMM.

    per-tensor or per-channel weight scales: torch._scaled_mm with row-wise scales, scale_a [M, 1] (each
        token's, or the static input_scale repeated) and scale_b [1, N] (each output channel's), bfloat16 out
        (the only output cuBLAS/CUTLASS row-wise scaling takes);
    block scales: the Triton kernel (kernels/triton/fp8_matmul.py), activations scaled per token per block
        columns.
A weight neither path takes (a block whose columns are not a power of two from 16 to 128, a dimension
_scaled_mm cannot tile) runs as its float value, with a log line.
Nothing here needs a GPU to run: on CPU tensors _scaled_mm has a reference implementation and the kernel
runs in Triton's interpreter, which is how the tests check it.
"""
import logging
from typing import Callable, NamedTuple

import torch

from tpengine.platforms import torch_ops
from tpengine.quantization.fp8 import Fp8Weight, quantize_fp8_activation

logger = logging.getLogger("tpengine")

FP8_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada and Hopper on; sm_80 has none
_SCALED_MM_MULTIPLE = 16  # _scaled_mm's K and N must be multiples of 16


class Fp8Linear(NamedTuple):
    """An Fp8Weight packed for its GEMM."""
    weight: torch.Tensor  # e4m3 [out, in]
    scales: torch.Tensor  # float32: [1, out] per output channel (_scaled_mm), or the [out / rows, in / columns] blocks
    block_size: tuple[int, int] | None  # None: the _scaled_mm path
    input_scale: torch.Tensor | None  # float32 [1, 1]: static; None: dynamic
    quantize: Callable = quantize_fp8_activation  # the CUDA platform's is compiled

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return fp8_linear(x, self, bias, self.quantize)


def runs_fp8(capability: tuple[int, int]) -> bool:
    return tuple(capability) >= FP8_MIN_CAPABILITY


def _gemm_takes(fp8: Fp8Weight) -> str | None:
    """Why neither GEMM takes this weight, or None."""
    out_features, in_features = fp8.shape
    if fp8.block_size is None:
        if out_features % _SCALED_MM_MULTIPLE or in_features % _SCALED_MM_MULTIPLE:
            return f"[{out_features}, {in_features}] is not in multiples of {_SCALED_MM_MULTIPLE} for _scaled_mm"
        return None
    columns = fp8.block_size[1]
    if columns < 16 or columns > 128 or columns & (columns - 1):
        return f"block columns {columns} are not a power of two from 16 to 128 for the FP8 block kernel"
    return None


def pack_fp8_weight(fp8: Fp8Weight, dtype: torch.dtype,
                    quantize: Callable = quantize_fp8_activation) -> Fp8Linear | torch_ops.DequantizedWeight:
    """fp8 packed for its GEMM, its inputs quantized by `quantize` (quantize_fp8_activation, compiled on CUDA); a
    weight neither GEMM takes as its float value in dtype."""
    problem = _gemm_takes(fp8)
    if problem is not None:
        logger.warning("an FP8 linear runs on its float weights: %s", problem)
        return torch_ops.DequantizedWeight(fp8.dequantize(dtype), "float")
    if fp8.block_size is None:  # one row-wise scale per output channel, a per-tensor one repeated
        scales = fp8.scales.expand(fp8.shape[0], 1).reshape(1, -1).contiguous()
    else:
        scales = fp8.scales.contiguous()
    return Fp8Linear(fp8.weight.contiguous(), scales, fp8.block_size, fp8.input_scale, quantize)


def fp8_linear(x: torch.Tensor, packed: Fp8Linear, bias: torch.Tensor | None,
               quantize=quantize_fp8_activation) -> torch.Tensor:
    """x [..., in] @ weight^T (+ bias) in x's dtype; `quantize` is quantize_fp8_activation, compiled on CUDA."""
    rows = x.reshape(-1, x.size(-1))
    if packed.block_size is None:
        values, scales = quantize(rows, None, packed.input_scale)
        out = torch._scaled_mm(values, packed.weight.t(), scale_a=scales, scale_b=packed.scales,
                               out_dtype=torch.bfloat16)
    else:
        from tpengine.kernels.triton.fp8_matmul import block_fp8_matmul
        values, scales = quantize(rows, packed.block_size[1], packed.input_scale)
        out = block_fp8_matmul(values, scales, packed.weight, packed.scales, packed.block_size, torch.bfloat16)
    out = out.to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], out.size(-1))
