"""Structured outputs' token masks applied on the CPU (token_bitmask.cpp), built on first use by
kernels/cpu/build.py and loaded as `torch.ops.tpengine_token_bitmask.apply_token_bitmask`: a row's logit
becomes -inf where its mask bit (xgrammar's layout, 32 tokens a word) is 0, whole words skipped or filled."""
import functools

import torch

from tpengine.kernels.cpu.build import build_and_load_or_warn


@functools.cache
def available() -> bool:
    """Whether the op is built and loaded here; the first failure is logged once."""
    return build_and_load_or_warn("token_bitmask.cpp", "masks are applied by xgrammar's")


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: logits[r, j] = -inf where bit j of bitmask[r] is 0, for r in rows. logits float32 [n, vocab]
    with contiguous rows; bitmask int32 [n, ceil(vocab / 32)]. Needs available()."""
    torch.ops.tpengine_token_bitmask.apply_token_bitmask(logits, bitmask, torch.tensor(rows, dtype=torch.int64))
