"""Recorded torch ops called again from C++ (op_replay.cpp), built on first use by kernels/cpu/build.py and loaded
as the class `torch.classes.tpengine_op_replay.OpReplay`: a replayed decode forward (tpengine/runner/cpu_replay.py)
without a Python call per op. Without a compiler the replay calls its ops from Python."""
import functools

import torch

from tpengine.kernels.cpu.build import build_and_load_or_warn

EMPTY_LIST = "<empty list>"  # an argument [] (op_replay.cpp's kEmptyList): the op's schema types it


@functools.cache
def available() -> bool:
    """Whether the class is built and loaded here; the first failure is logged once."""
    return build_and_load_or_warn("op_replay.cpp", "replayed ops are called from Python")


def new_program():
    """An empty OpReplay: add(name, overload, arguments, input_positions, input_slots, output_slots, returns_list)
    per op, in order (arguments: every schema argument, a computed input as None at its position, filled from its
    slot), then run(result_slot) -> the tensor in that slot; or, with host calls between ops, start(),
    run_to(n, slot) (the ops up to the n-th, then a call's tensor), finish(result_slot). Needs available()."""
    return torch.classes.tpengine_op_replay.OpReplay()
