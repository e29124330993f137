"""Batch-invariant linears (EngineConfig.batch_invariant): a matmul's kernel, and so each output's reduction order,
may follow the number of rows (a GEMV for one row, split sums for few); here every call multiplies row tiles of one
fixed size, the last padded with zeros, so a row's outputs are the same bits whatever else is in the batch.
Layers built inside `building_batch_invariant(True)` take their platform's linear through `row_tiled`."""
import threading
from contextlib import contextmanager

import torch
import torch.nn.functional as F

ROWS_PER_TILE = 16  # a decode batch up to 16 is one call; a prompt chunk costs a call per 16 tokens

_building = threading.local()


@contextmanager
def building_batch_invariant(enabled: bool):
    """Layers constructed inside this block (in this thread) multiply in fixed row tiles when enabled."""
    previous = getattr(_building, "enabled", False)
    _building.enabled = enabled
    try:
        yield
    finally:
        _building.enabled = previous


def model_linear(linear):
    """The platform's linear(x, weight, bias, packed_weight) as the layer being built should call it."""
    return row_tiled(linear) if getattr(_building, "enabled", False) else linear


def row_tiled(linear):
    def tiled(x: torch.Tensor, weight, bias, packed_weight):
        rows = x.reshape(-1, x.size(-1))
        num_rows = rows.size(0)
        padding = -num_rows % ROWS_PER_TILE
        if padding:
            rows = F.pad(rows, (0, 0, 0, padding))
        out = torch.cat([linear(tile, weight, bias, packed_weight) for tile in rows.split(ROWS_PER_TILE)])
        return out[:num_rows].reshape(*x.shape[:-1], out.size(-1))
    return tiled
