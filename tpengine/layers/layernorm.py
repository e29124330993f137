"""RMSNorm, with the residual add fused in: it returns the normed value and the new residual."""
import torch
from torch import nn

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
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)
