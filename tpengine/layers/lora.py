"""LoRA adapter slots on the linear layers: every row of a step adds its adapter's x @ A @ B * scale to the base
layer's output, by the row's slot (-1: the base alone), in one op per layer (the platform's lora_add: grouped as
Punica's SGMV, kernels/cpu/lora.cpp and kernels/triton/lora.py).

Each linear keeps max_loras slots per projection: A as [slots, input features, rank] and B as [slots, rank, output
features], zero beyond an adapter's rank, so the sum over the padded rank is the adapter's own. A linear packing
several projections (q/k/v, gate/up) adds each one's into its own output columns (one op per part: a single
block-diagonal B would multiply the other parts' zeros). Sharded as the base weight: a column-parallel layer keeps
all of A and its rows of B; a row-parallel one its columns of A and all of B, and adds its share to the partial
sums the all-reduce already adds up."""
import torch

from tpengine.layers.batch_invariant import lora_add_in_row_tiles
from tpengine.layers.linear import FUSED, ColumnParallelLinear, LinearBase, RowParallelLinear
from tpengine.platforms import platform_for

# the linears an adapter may target: the attention's and the MLP's projections (not the router or the experts)
LORA_LINEARS = (ColumnParallelLinear, RowParallelLinear)


class LoRARows:
    """Each row's adapter slot for the step being run, in one buffer every LoRA layer of a model reads (its first
    rows): a static tensor, so a recorded CPU decode step or a CUDA graph reads each step's slots in place."""

    def __init__(self, max_num_rows: int, device: torch.device):
        self.slots = torch.full((max_num_rows,), -1, dtype=torch.int64, device=device)

    def set(self, slots: torch.Tensor) -> None:
        """The step's slots, padding rows' -1 included; rows past them keep stale slots that only padding reads."""
        assert slots.size(0) <= self.slots.size(0), "more rows than the LoRA row buffer holds"
        self.slots[:slots.size(0)].copy_(slots)

    def of(self, num_rows: int) -> torch.Tensor:
        return self.slots[:num_rows]


class LoRAPart:
    """One projection's slots within a linear (q, k or v of a packed q/k/v; the whole of a plain one): A as [slots,
    input features, rank], B as [slots, rank, its output columns on this rank], each slot's scale."""

    def __init__(self, offset: int, size: int, input_size: int, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device):
        self.offset, self.size = offset, size      # its columns of the layer's output on this rank
        self.lora_a = torch.zeros(max_loras, input_size, max_rank, dtype=dtype, device=device)
        self.lora_b = torch.zeros(max_loras, max_rank, size, dtype=dtype, device=device)
        self.scales = torch.zeros(max_loras, dtype=torch.float32, device=device)

    def write(self, slot: int, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        """This rank's A [in, rank] and B [rank, columns] of one adapter, zero past its rank."""
        rank = a.size(1)
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.lora_a[slot, :, :rank] = a
        self.lora_b[slot, :rank] = b
        self.scales[slot] = scale

    def clear(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.scales[slot] = 0.0


class LoRAWeights:
    """One linear's adapter slots, part by part (a packed linear's projections each add into their own output
    columns, so no part multiplies another's zeros); add() is its share of the forward, write_slot() puts an
    adapter in a slot."""

    def __init__(self, layer: LinearBase, rows: LoRARows, max_loras: int, max_rank: int, dtype: torch.dtype,
                 batch_invariant: bool = False):
        self.layer = layer
        self.rows = rows
        self.row_parallel = isinstance(layer, RowParallelLinear)
        device = rows.slots.device
        shards = {None: (0, 0, layer.output_size)} if self.row_parallel else \
            {shard_id: layer.output_shard(shard_id) for shard_id in layer.output_parts()}
        self.parts = {shard_id: LoRAPart(offset, size, layer.input_size, max_loras, max_rank, dtype, device)
                      for shard_id, (offset, _, size) in shards.items()}
        self.whole = len(self.parts) == 1  # one part covering every output column: it adds into y itself
        self.lora_add = lora_add_in_row_tiles if batch_invariant else platform_for(device).lora_add

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        slots = self.rows.of(x.size(0))
        for part in self.parts.values():
            out = y if self.whole else y[:, part.offset:part.offset + part.size]
            self.lora_add(out, x, part.lora_a, part.lora_b, part.scales, slots)

    def write_slot(self, slot: int, parts: dict) -> None:
        """Put an adapter's weights for this layer in slot: parts maps the layer's shard id (None: the whole
        layer; FUSED: every part in one, Phi-3's qkv_proj, one A for all) to the checkpoint's (A [rank, in],
        B [out, rank], scale), whole as saved; a part the adapter lacks is cleared."""
        layer = self.layer
        if FUSED in parts:  # one A for every part, B's rows in the parts' order
            a, b, scale = parts[FUSED]
            sizes, start = layer.output_parts(), 0
            parts = {}
            for shard_id, size in sizes.items():
                parts[shard_id] = (a, b[start:start + size], scale)
                start += size
        for shard_id, part in self.parts.items():
            if shard_id not in parts:
                part.clear(slot)
                continue
            a, b, scale = parts[shard_id]
            if self.row_parallel:  # this rank's input columns of A, all of B
                size = layer.input_size
                part.write(slot, a[:, layer.tp_rank * size:(layer.tp_rank + 1) * size].t(), b.t(), scale)
            else:  # all of A, this rank's rows of B
                _, start, size = layer.output_shard(shard_id)
                part.write(slot, a.t(), b[start:start + size].t(), scale)


def attach_lora(model: torch.nn.Module, max_loras: int, max_rank: int, max_num_rows: int,
                dtype: torch.dtype, device: torch.device, batch_invariant: bool = False) -> dict[str, LoRAWeights]:
    """Give every LoRA-capable linear of model its slots (all sharing one LoRARows); returns them by module
    name. batch_invariant: each row's adapter product its own, in fixed row tiles (layers/batch_invariant.py)."""
    rows = LoRARows(max_num_rows, device)
    layers = {}
    for name, module in model.named_modules():
        # the decoder's layers only: an image model's vision tower has linears of its own, never adapted
        if isinstance(module, LORA_LINEARS) and name.startswith("model.layers."):
            module.lora = layers[name] = LoRAWeights(module, rows, max_loras, max_rank, dtype, batch_invariant)
    return layers
