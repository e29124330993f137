"""The C++ shared-memory all-reduce (shm_allreduce.cpp), built on first use by kernels/cpu/build.py and
loaded as the torch op `torch.ops.tpengine_shm.all_reduce`; tpengine/distributed/shm/all_reduce.py
maps the segment and drives it."""
import functools

from tpengine.kernels.cpu.build import build_and_load


@functools.cache
def load() -> None:
    """Build the op if this machine has no build of it yet, then load it; RuntimeError saying why not."""
    build_and_load("shm_allreduce.cpp")
