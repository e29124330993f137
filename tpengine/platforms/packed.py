"""A weight in the form a platform's kernel multiplies, made once after loading (prepack): each form multiplies
itself (`matmul`) and, where an embedding table is kept in it, gathers its own rows (`rows`). A platform's linear
and embedding_rows call the method, so a new form (an adapter, another quantized type) is one class beside its
kernel, not a branch in every platform.

The forms: cpu.py's QuantizedLinear and Bf16Blocks, cuda.py's TritonQuantLinear, cuda_fp8.py's Fp8Linear and
torch_ops.py's DequantizedWeight (a quantized weight on a platform without its kernel). A float weight no platform
packed is the parameter itself, multiplied by F.linear; the CPU's oneDNN copy is a plain tensor too (cpu.linear).
"""
from typing import Protocol

import torch
import torch.nn.functional as F


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
