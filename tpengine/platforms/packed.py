"""A weight in the form a platform's kernel multiplies, made once after loading (prepack): each form multiplies
itself (`matmul`) and, where an embedding table is kept in it, gathers its own rows (`rows`). A platform's linear
and embedding_rows call the method, so a new form (an adapter, another quantized type) is one class beside its
kernel, not a branch in every platform.

The forms: cpu.py's QuantizedLinear and Bf16Blocks, cuda.py's TritonQuantLinear, cuda_fp8.py's Fp8Linear and
torch_ops.py's DequantizedWeight (a quantized weight on a platform without its kernel), and MinimumCorrected here
around any quantized one whose groups have a float minimum (GGUF's Q4_K, ...). A float weight no platform packed is
the parameter itself, multiplied by F.linear; the CPU's oneDNN copy is a plain tensor too (cpu.linear).
"""
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F

from tpengine.quantization.weights import quantize_per_token


class PackedWeight(Protocol):
    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in] @ weight^T (+ bias) -> [..., out], in x's dtype."""


class PackedTable(PackedWeight, Protocol):
    """A form an embedding table may be kept in (a quantized table's, or one kept in bfloat16 on a CPU)."""

    def rows(self, token_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The table's rows of token_ids [...] -> [..., hidden], in dtype."""


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed_weight: PackedWeight | None) -> torch.Tensor:
    """x @ weight^T (+ bias), on packed_weight where prepack made one (then weight may be empty)."""
    if packed_weight is None:
        return F.linear(x, weight, bias)
    return packed_weight.matmul(x, bias)


def embedding_rows(token_ids: torch.Tensor, packed_weight: PackedTable, dtype: torch.dtype) -> torch.Tensor:
    """Rows of an embedding table stored as prepack made it, in dtype."""
    return packed_weight.rows(token_ids, dtype)


def packed_linear(x: torch.Tensor, packed_weight: PackedWeight) -> torch.Tensor:
    """grouped_experts' linear over quantized experts' packs (no bias: the experts add theirs)."""
    return packed_weight.matmul(x, None)


class MinimumCorrected(NamedTuple):
    """A quantized weight whose groups have a float minimum (QuantizedWeight.minimums), which no kernel reads: the
    kernel's pack of it without the minimums (inner), less each row's group sums of x times the minimums,
    x @ (W + m)^T - sums(x) @ m^T. Both in float32, rounded once: the two terms can be larger than their difference,
    so a half x's product rounded first would lose digits of it. In ops a CPU decode step can record
    (runner/cpu_replay.py): the sums are group means times group_size, exact for a power of two."""
    inner: PackedWeight
    minimums: torch.Tensor  # float32 [out, groups]
    group_size: int
    # the kernel multiplies each token's input quantized to int8: the minimums' sums are of the same values (as
    # llama.cpp's K-quant dot products sum the quantized block)
    int8_input: bool = False

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x32 = x.float()
        if self.int8_input:
            values, scales = quantize_per_token(x32)
            summed = values.float() * scales
        else:
            summed = x32
        sums = summed.reshape(*x.shape[:-1], -1, self.group_size).mean(-1) * self.group_size
        y = self.inner.matmul(x32, None) - F.linear(sums, self.minimums)
        if bias is not None:
            y = y + bias
        return y.to(x.dtype)

    def rows(self, token_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """An embedding table's rows, exactly as QuantizedWeight.dequantize gives them."""
        rows = self.inner.rows(token_ids, torch.float32)
        groups = rows.reshape(*rows.shape[:-1], -1, self.group_size)
        return (groups - F.embedding(token_ids, self.minimums).unsqueeze(-1)).reshape(rows.shape).to(dtype)


def with_minimums(quantized, packed: PackedWeight) -> PackedWeight:
    """What a platform makes of a QuantizedWeight its kernel packed (packed, from the weight's qweight, scales and
    zeros alone): packed itself, or MinimumCorrected where the weight has minimums. Each group a run of group_size
    columns dividing the inputs (GGUF's blocks)."""
    if quantized.minimums is None:
        return packed
    assert quantized.group_index is None and quantized.shape[1] % quantized.group_size == 0
    return MinimumCorrected(packed, quantized.minimums, quantized.group_size, quantized.activation == "int8")
