"""The CPU sampling kernel (sampling.cpp), built on first use by kernels/cpu/build.py and loaded as the
torch op `torch.ops.tpengine_sampling.sample_rows`: argmax or an inverse-CDF draw per row of float32
logits, without the full-vocabulary cumulative sum the torch path writes."""
import functools
import logging

import torch

from tpengine.kernels.cpu.build import build_and_load

logger = logging.getLogger("tpengine")


@functools.cache
def available() -> bool:
    """Whether the op is built and loaded here; the first failure is logged once."""
    try:
        build_and_load("sampling.cpp")
    except (RuntimeError, OSError) as error:  # no compiler, a failed build, an unwritable cache folder
        logger.warning("could not build the CPU sampling kernel (%s): the CPU samples with torch", error)
        return False
    return True


def sample_rows(logits: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row of float32 logits [rows, vocab]: the argmax where temperatures (float32) is 0, else the
    inverse-CDF draw of uniforms (float64, in [0, 1)) from softmax(logits / temperature); -1 where a row
    has a NaN or no finite maximum. Needs available()."""
    out = torch.empty(logits.size(0), dtype=torch.int64)
    torch.ops.tpengine_sampling.sample_rows(logits, temperatures, uniforms, out)
    return out
