"""RMSNorm, with the residual add fused in: it returns the normed value and the new residual.

Each call runs its platform's op (tpengine/platforms): one C++ op on the CPU where it is built, the torch
code compiled on CUDA.
"""
import torch
from torch import nn

from tpengine.platforms import current_platform


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        platform = current_platform()
        self.rms_norm, self.add_rms_norm = platform.rms_norm, platform.add_rms_norm

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x normed; with a residual, (x + residual normed, x + residual). The CPU's C++ op writes both in
        place, into x and residual: the decoder hands over tensors it no longer reads."""
        if residual is None:
            return self.rms_norm(x, self.weight, self.eps)
        return self.add_rms_norm(x, residual, self.weight, self.eps)
