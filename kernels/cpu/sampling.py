"""The CPU sampling kernel (sampling.cpp), built on first use by kernels/cpu/build.py and loaded as the
torch ops `torch.ops.tpengine_sampling.*`: argmax or an inverse-CDF draw per row of float32 logits,
over one vocabulary or its tensor-parallel slices, without the full-vocabulary cumulative sum the torch
path writes.

A sampled row's token is where uniform * total falls in the cumulative mass of softmax(logits / t),
slices taken in order; temperature 0 is the first index of the maximum; -1 where a row has a NaN or no
finite maximum.
"""
import functools

import torch

from tpengine.kernels.cpu.build import build_and_load_or_warn

STATS = 3  # per row and slice: maximum, sum of exp((x - maximum) / t), first index of the maximum
BLOCK = 256  # entries per block sum (sampling.cpp's kBlock)


@functools.cache
def available() -> bool:
    """Whether the ops are built and loaded here; the first failure is logged once."""
    return build_and_load_or_warn("sampling.cpp", "the CPU samples with torch")


def slice_stats(logits: torch.Tensor, temperatures: torch.Tensor, bitmask: torch.Tensor | None = None,
                offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of one slice of float32 logits [rows, n]: its stats [rows, STATS] (float64) and block sums.
    bitmask: the rows' token masks (xgrammar's int32 [rows, words] over the whole vocabulary; the slice's
    entries are tokens offset..offset + n), a masked-out logit read as -inf."""
    rows, n = logits.shape
    stats = torch.empty(rows, STATS, dtype=torch.float64)
    sums = torch.empty(rows, -(-n // BLOCK), dtype=torch.float64)
    torch.ops.tpengine_sampling.slice_stats(logits, temperatures, stats, sums, bitmask, offset)
    return stats, sums


def slice_tokens(logits: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor, all_stats: torch.Tensor,
                 sums: torch.Tensor, slice: int, offset: int, out: torch.Tensor,
                 bitmask: torch.Tensor | None = None) -> None:
    """Into out (float64 [rows]): offset + the token's index in this slice for the rows whose draw it
    holds, -1 (slice 0) for rows without a distribution; other rows left alone. all_stats: every slice's
    stats, [slices, rows, STATS]; bitmask as slice_stats took it."""
    torch.ops.tpengine_sampling.slice_tokens(logits, temperatures, uniforms, all_stats, sums, slice, offset, out,
                                             bitmask)


def slice_bounds(vocab: int, num_slices: int) -> list[tuple[int, int]]:
    """The columns of each tensor-parallel rank's slice of a vocabulary of `vocab` entries: ceil(vocab /
    num_slices) each, as the vocabulary-parallel LM head splits it, the last one short."""
    width = -(-vocab // num_slices)
    return [(min(r * width, vocab), min((r + 1) * width, vocab)) for r in range(num_slices)]


def sample_rows(logits: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor,
                num_slices: int = 1, bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """Tokens (int64 [rows]) of float32 logits [rows, vocab] held whole, cut into num_slices slices as
    tensor-parallel ranks hold them: the same tokens those ranks would sample. temperatures float32,
    uniforms float64 in [0, 1), both [rows]; bitmask: the rows' token masks (structured outputs), int32
    [rows, words] as xgrammar fills them, the same tokens as after writing -inf where they mask. Needs
    available()."""
    bounds = slice_bounds(logits.size(1), num_slices)
    pieces = [logits[:, start:end] for start, end in bounds]
    stats = [slice_stats(piece, temperatures, bitmask, start) for piece, (start, _) in zip(pieces, bounds)]
    all_stats = torch.stack([s for s, _ in stats])
    out = torch.zeros(logits.size(0), dtype=torch.float64)
    for r, (piece, (_, sums)) in enumerate(zip(pieces, stats)):
        slice_tokens(piece, temperatures, uniforms, all_stats, sums, r, bounds[r][0], out, bitmask)
    return out.long()
