"""torch.compile for the small elementwise ops, on CUDA only.

On CPU the function runs as written, in transformers' op order. Compiled, these ops were faster
on 2 CPU cores at prefill sizes, but the first compile costs 1-14 s, which would dominate short
CPU runs, and the fused RMSNorm rounds differently (docs/benchmarks.md).
"""
import functools
import logging

import torch

logger = logging.getLogger("tpengine")


def compiled_on_cuda(fn):
    """fn itself for CPU tensors; torch.compile(fn), built on first use, when the first argument is on CUDA.

    Should compiling ever fail here, fn runs eagerly from then on, with a warning: compiling is only
    an optimisation.
    """
    compiled = None

    @functools.wraps(fn)
    def dispatch(x: torch.Tensor, *args):
        nonlocal compiled
        if not x.is_cuda or compiled is False:
            return fn(x, *args)
        if compiled is None:
            # shapes left to dynamo: the token dimension turns dynamic after the second size it sees
            compiled = torch.compile(fn)
        try:
            return compiled(x, *args)
        except Exception as e:  # any compiler failure: the eager function is the fallback
            logger.warning("torch.compile of %s failed (%s: %s); running it eagerly", fn.__name__,
                           type(e).__name__, e)
            compiled = False
            return fn(x, *args)

    return dispatch
