"""Batch-invariant linears (EngineConfig.batch_invariant): a matmul's kernel, and so each output's reduction order,
may follow the number of rows (a GEMV for one row, split sums for few); here every call multiplies row tiles of one
fixed size, the last padded with zeros, so a row's outputs are the same bits whatever else is in the batch.
Layers built inside `building_batch_invariant(True)` take their platform's linear through `row_tiled`; a mixture of
experts runs grouped by expert, each expert's rows in tiles (`row_tiled_experts`), its tokens' sums in expert order."""
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
    return row_tiled(linear) if is_building_batch_invariant() else linear


def is_building_batch_invariant() -> bool:
    return getattr(_building, "enabled", False)


def in_row_tiles(multiply, x: torch.Tensor) -> torch.Tensor:
    """multiply(tile) over x's rows in tiles of ROWS_PER_TILE (the last padded with zero rows), joined."""
    rows = x.reshape(-1, x.size(-1))
    num_rows = rows.size(0)
    padding = -num_rows % ROWS_PER_TILE
    if padding:
        rows = F.pad(rows, (0, 0, 0, padding))
    out = torch.cat([multiply(tile) for tile in rows.split(ROWS_PER_TILE)])
    return out[:num_rows].reshape(*x.shape[:-1], out.size(-1))


def row_tiled(linear):
    """A platform's linear(x, weight, bias, packed_weight) multiplying in row tiles."""
    return lambda x, weight, bias, packed_weight: in_row_tiles(
        lambda tile: linear(tile, weight, bias, packed_weight), x)


def row_tiled_experts(linear):
    """An experts' linear(x, weight) (torch_ops.grouped_experts') multiplying each expert's rows in row tiles."""
    return lambda x, weight: in_row_tiles(lambda tile: linear(tile, weight), x)


def lora_add_in_row_tiles(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                          scales: torch.Tensor, slots: torch.Tensor) -> None:
    """The platforms' lora_add (y[t] += scales[s] * (x[t] @ lora_a[s]) @ lora_b[s] for slot s = slots[t] >= 0, in
    float32, rounded once), batch-invariant: each row multiplies its own slot's A and B, gathered (so neither the
    slot an adapter sits in nor the other rows' adapters move its sums), in tiles of ROWS_PER_TILE rows."""
    num_rows, padding = x.size(0), -x.size(0) % ROWS_PER_TILE
    padded_x = F.pad(x.float(), (0, 0, 0, padding))
    padded_slots = F.pad(slots, (0, padding), value=-1).clamp(min=0)
    deltas = []
    for tile, tile_slots in zip(padded_x.split(ROWS_PER_TILE), padded_slots.split(ROWS_PER_TILE)):
        shrunk = torch.bmm(tile.unsqueeze(1), lora_a[tile_slots].float())  # [rows, 1, rank]
        deltas.append(torch.bmm(shrunk, lora_b[tile_slots].float())[:, 0] * scales[tile_slots].unsqueeze(1))
    updated = (y.float() + torch.cat(deltas)[:num_rows]).to(y.dtype)
    y.copy_(torch.where((slots >= 0).unsqueeze(1), updated, y))
