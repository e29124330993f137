"""int4/int8 linears on CUDA: a QuantizedWeight packed once after loading into Triton's GEMM layout
(kernels/triton/quant_matmul.py), which multiplies itself. Imported where Triton is installed (cuda.py asks
HAS_TRITON first); like cuda_fp8.py, it runs on CPU tensors too, in Triton's interpreter, which is how the tests
check it."""
import torch

from tpengine.kernels.triton.quant_matmul import QuantMatmulWeight, dequantize_rows, pack_weight, quant_matmul
from tpengine.quantization.weights import QuantizedWeight, quantize_per_token


class TritonQuantLinear(QuantMatmulWeight):
    """The kernel's weight layout (the kernel module knows tensors only), with the platform's matmul and rows."""
    __slots__ = ()

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.activation == "int8":  # W8A8: x quantized per token as it arrives
            values, scales = quantize_per_token(x)
            return quant_matmul(values, self, bias, x_scales=scales, out_dtype=x.dtype)
        return quant_matmul(x, self, bias)

    def rows(self, token_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows of a quantized embedding table, dequantized as they are gathered."""
        return dequantize_rows(self, token_ids.flatten()).view(*token_ids.shape, -1).to(dtype)


def pack_quant_weight(quantized: QuantizedWeight) -> TritonQuantLinear:
    """quantized in the kernel's layout, act-order columns sorted by group; a ValueError names a group size or zero
    point the kernel does not take."""
    contiguous, input_order = quantized.with_contiguous_groups()
    return TritonQuantLinear._make(pack_weight(contiguous.qweight, contiguous.scales, contiguous.zeros, contiguous.bits,
                                               contiguous.group_size, input_order, quantized.shape[1],
                                               quantized.activation))
