"""RMSNorm, with the residual add fused in: it returns the normed value and the new residual.

On the CPU each call is one C++ op (kernels/cpu/fused_ops.cpp) where it is built: the torch code below
is six ops, each a dispatch and an allocation, which at decode sizes cost more than the arithmetic.
"""
import torch
from torch import nn

from tpengine.kernels.cpu import fused_ops
from tpengine.layers.compile import compiled_on_cuda


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    orig_dtype = x.dtype
    x = x.float()  # variance in float32, as transformers computes it
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    # transformers' weight * x, in place on the fresh product: the same values, and on the CPU
    # several times faster than broadcasting the weight as the first operand into a new tensor
    return x.to(orig_dtype).mul_(weight)


rms_norm = compiled_on_cuda(_rms_norm)


@compiled_on_cuda
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    residual = x + residual
    return _rms_norm(residual, weight, eps), residual


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x normed; with a residual, (x + residual normed, x + residual). The fused CPU op writes both
        in place, into x and residual: the decoder hands over tensors it no longer reads."""
        fused = fused_ops.usable(x) and x.stride(-1) == 1
        if residual is None:
            return fused_ops.rms_norm(x, self.weight, self.eps) if fused else rms_norm(x, self.weight, self.eps)
        if fused and residual.is_contiguous() and x.is_contiguous():
            return fused_ops.add_rms_norm_(x, residual, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)
