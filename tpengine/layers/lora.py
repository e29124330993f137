"""LoRA adapter slots on the linear layers: every row of a step adds its adapter's x @ A @ B * scale to the base
layer's output, by the row's slot (-1: the base alone), in one op per layer (the platform's lora_add: grouped as
Punica's SGMV, kernels/cpu/lora.cpp and kernels/triton/lora.py).

Each linear keeps max_loras slots: A as [slots, input features, rank] and B as [slots, rank, output features],
zero beyond an adapter's rank and where it has no weights, so the sum over the padded rank is the adapter's own.
A linear packing several projections (q/k/v, gate/up) stacks its parts' A along the rank and places each part's
B in its rows of the output: one shrink and one expand serve every part. Sharded as the base weight: a
column-parallel layer keeps all of A and its rows of B; a row-parallel one its columns of A and all of B, and adds
its share to the partial sums the all-reduce already adds up."""
import torch

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


class LoRAWeights:
    """One linear's adapter slots; add() is its share of the forward, write_slot() puts an adapter in a slot."""

    def __init__(self, layer: LinearBase, rows: LoRARows, max_loras: int, max_rank: int, dtype: torch.dtype):
        self.layer = layer
        self.rows = rows
        self.row_parallel = isinstance(layer, RowParallelLinear)
        self.parts = {None: None} if self.row_parallel else layer.output_parts()
        self.max_rank = max_rank
        input_size, output_size = layer.input_size, layer.output_size
        device = rows.slots.device
        rank = max_rank * len(self.parts)  # each packed part's A in its own columns
        self.lora_a = torch.zeros(max_loras, input_size, rank, dtype=dtype, device=device)
        self.lora_b = torch.zeros(max_loras, rank, output_size, dtype=dtype, device=device)
        self.scales = torch.zeros(max_loras, dtype=torch.float32, device=device)
        self.lora_add = platform_for(device).lora_add

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.lora_add(y, x, self.lora_a, self.lora_b, self.scales, self.rows.of(x.size(0)))

    def write_slot(self, slot: int, parts: dict) -> None:
        """Put an adapter's weights for this layer in slot: parts maps the layer's shard id (None: the whole
        layer; FUSED: every part in one, Phi-3's qkv_proj) to the checkpoint's (A [rank, in], B [out, rank],
        scale), whole as saved; parts the adapter lacks stay zero. Each part's scale multiplies the slot's
        product (peft's order) where every part has the same one, else is folded into its B."""
        lora_a, lora_b = self.lora_a[slot], self.lora_b[slot]
        lora_a.zero_()
        lora_b.zero_()
        scales = {scale for _, _, scale in parts.values()}
        fold = len(scales) > 1
        self.scales[slot] = 1.0 if fold or not scales else scales.pop()
        column = 0
        for shard_id, (a, b, scale) in parts.items():
            if fold:
                b = b * scale
            column = self._write_part(lora_a, lora_b, column, shard_id, a, b)

    def _write_part(self, lora_a: torch.Tensor, lora_b: torch.Tensor, column: int, shard_id, a: torch.Tensor,
                    b: torch.Tensor) -> int:
        """One checkpoint part's A into the rank columns from column on, its B into its output rows; returns the
        next free column."""
        layer, rank = self.layer, a.size(0)
        if self.row_parallel:
            size = lora_a.size(0)
            lora_a[:, column:column + rank] = a[:, layer.tp_rank * size:(layer.tp_rank + 1) * size].t()
            lora_b[column:column + rank] = b.t()
            return column + rank
        lora_a[:, column:column + rank] = a.t()
        if shard_id == FUSED:  # one A for every part, B's rows in the parts' order
            start = 0
            for part, size in self.parts.items():
                self._place_rows(lora_b, column, rank, part, b[start:start + size])
                start += size
        else:
            self._place_rows(lora_b, column, rank, shard_id, b)
        return column + rank

    def _place_rows(self, lora_b: torch.Tensor, column: int, rank: int, shard_id, b: torch.Tensor) -> None:
        offset, start, size = self.layer.output_shard(shard_id)
        lora_b[column:column + rank, offset:offset + size] = b[start:start + size].t()


def attach_lora(model: torch.nn.Module, max_loras: int, max_rank: int, max_num_rows: int,
                dtype: torch.dtype, device: torch.device) -> dict[str, LoRAWeights]:
    """Give every LoRA-capable linear of model its slots (all sharing one LoRARows); returns them by module
    name."""
    rows = LoRARows(max_num_rows, device)
    layers = {}
    for name, module in model.named_modules():
        if isinstance(module, LORA_LINEARS) and ".layers." in f".{name}":
            module.lora = layers[name] = LoRAWeights(module, rows, max_loras, max_rank, dtype)
    return layers
