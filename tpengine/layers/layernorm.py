"""RMSNorm (and Gemma's variant), with the residual add fused in: it returns the normed value and the new residual.

Each call runs its platform's op (tpengine/platforms): one C++ op on the CPU where it is built, the torch
code compiled on CUDA.
"""
import torch
from torch import nn

from tpengine.layers.load_state import attach, check_weight_shape
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


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: x normed, times (1 + weight), both in float32, then rounded to x's dtype (transformers'
    Gemma2RMSNorm / Gemma3RMSNorm). The parameter holds 1 + the checkpoint's weight, in float32, so a float32
    model runs the platform's RMSNorm (the CPU's C++ op), which then computes the same values; other dtypes
    run the torch code below, which rounds once, after the scale, as transformers does."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=torch.float32), requires_grad=False)
        attach(self.weight, self._load_weight)
        platform = current_platform()
        self.rms_norm, self.add_rms_norm = platform.rms_norm, platform.add_rms_norm

    @staticmethod
    def _load_weight(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        check_weight_shape(loaded_weight, param.shape)
        param.data.copy_(1.0 + loaded_weight.float())

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x normed; with a residual, (x + residual normed, x + residual), the sum in x's dtype as transformers
        adds. The platform's ops may write into x and residual, as RMSNorm's do."""
        if x.dtype == torch.float32:
            if residual is None:
                return self.rms_norm(x, self.weight, self.eps)
            return self.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)
