import torch
import torch.nn.functional as F
from torch import nn

from tpengine.platforms import current_platform


class SiluAndMul(nn.Module):
    """silu(gate) * up, with gate and up packed in the last dimension: one C++ pass on the CPU (torch's
    values), the torch code compiled on CUDA."""

    def __init__(self):
        super().__init__()
        self.silu_and_mul = current_platform().silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.silu_and_mul(x)


class GeluTanhAndMul(nn.Module):
    """gelu(gate) * up with GELU's tanh approximation (Gemma's gelu_pytorch_tanh), gate and up packed in the last
    dimension: torch's op, so torch's values, on every platform."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, -1)
        return F.gelu(gate, approximate="tanh").mul_(up)  # in place on gelu's fresh output
