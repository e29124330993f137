"""Linear layers that shard across the tensor-parallel group; each parameter loads its own shard. They
multiply through their platform's linear: on the CPU, on a copy of the weight packed once after loading.

A weight loads either as a float tensor, as a QuantizedWeight (a quantized checkpoint's, or a float one's
quantized at load) or as an Fp8Weight (where the platform multiplies FP8): the same shard of rows or columns is
taken of each. What loading tracks on a parameter, quantized parts waiting for prepack included, is its LoadState
(load_state.py).
"""
from typing import NamedTuple

import torch
from torch import nn

from tpengine.distributed.parallel_state import divide, get_tp_group
from tpengine.layers.batch_invariant import model_linear
from tpengine.layers.load_state import Loaded, attach, check_weight_shape, keep_quantized, packed_as_loaded
from tpengine.platforms import current_platform
from tpengine.quantization.fp8 import Fp8Weight
from tpengine.quantization.weights import QuantizedWeight

class OutputShard(NamedTuple):
    offset: int     # first row in this rank's output
    start: int      # first checkpoint row of this rank's share
    size: int


# the shard id of a checkpoint tensor that holds every part of a packed parameter at once, in order (Phi-3's
# qkv_proj and gate_up_proj): its loader splits it and loads each part as the split checkpoints' are loaded
FUSED = "fused"


def take_rows(loaded: Loaded, start: int, size: int) -> Loaded:
    return loaded.narrow(0, start, size) if isinstance(loaded, torch.Tensor) else loaded.rows(start, size)


def load_fused(param: nn.Parameter, loaded: Loaded, part_sizes: dict, load_part) -> None:
    """A checkpoint tensor holding every part of a packed parameter, stacked by rows in part_sizes' order: each
    part goes through the per-part loader (load_part(param, part, shard_id)), so it is sharded as a part would."""
    check_weight_shape(loaded, [sum(part_sizes.values()), *param.shape[1:]])
    start = 0
    for shard_id, size in part_sizes.items():
        load_part(param, take_rows(loaded, start, size), shard_id)
        start += size


def expect_loader_shards(module: nn.Module, shards: list[tuple]) -> None:
    """A packed parameter is filled by several checkpoint tensors, one per weight_loader argument tuple (or by
    one FUSED tensor holding them all): record them, so the loader can name a part the checkpoint lacks (a
    missing k_proj, say)."""
    for param in module.parameters(recurse=False):
        param.load_state.shards = shards


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None):
        super().__init__()
        self.tp_dim = tp_dim
        self.tp_group = get_tp_group()
        self.tp_rank = self.tp_group.rank
        self.tp_size = self.tp_group.size
        self.input_size, self.output_size = input_size, output_size  # this rank's: the weight's shape
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        # the loader may hand its weight_loader a QuantizedWeight and, where the platform multiplies FP8, an Fp8Weight
        attach(self.weight, self.weight_loader, takes=(QuantizedWeight, Fp8Weight))
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            attach(self.bias, self.weight_loader)
        else:
            self.register_parameter("bias", None)
        platform = current_platform()
        self.pack_linear_weight, self.linear = platform.pack_linear_weight, model_linear(platform.linear)
        self.pack_quantized_weight = platform.pack_quantized_weight
        self.packed_weight = None
        self.lora = None  # the layer's LoRA adapter slots (layers/lora.py), when the engine serves adapters

    def prepack(self, weight_dtype: torch.dtype | None = None) -> None:
        """After loading: matmul on the platform's packed copy of the weight where it makes one (the CPU's, or
        any platform's of a quantized weight), and free the plain weight it replaces. weight_dtype: the platform's
        linear_weight_dtype, where the copy keeps its weights in another dtype than the model's."""
        self.packed_weight = packed_as_loaded(self.weight, weight_dtype, self.pack_quantized_weight,
                                              self.pack_linear_weight)
        if self.packed_weight is None:
            self.packed_weight = self.pack_linear_weight(self.weight)
        if self.packed_weight is not None:
            self.weight.data = self.weight.data.new_empty(0)

    def weight_loader(self, param: nn.Parameter, loaded_weight: Loaded) -> None:
        whole = list(param.shape)
        if self.tp_dim is not None and self.tp_dim < param.dim():
            whole[self.tp_dim] *= self.tp_size
        check_weight_shape(loaded_weight, whole)
        if self.tp_dim is not None and self.tp_size > 1:
            shard_size = param.size(self.tp_dim)
            start = self.tp_rank * shard_size
            if not isinstance(loaded_weight, torch.Tensor):
                loaded_weight = loaded_weight.rows(start, shard_size) if self.tp_dim == 0 else \
                    loaded_weight.columns(start, shard_size, self.tp_size)
            else:
                loaded_weight = loaded_weight.narrow(self.tp_dim, start, shard_size)
        self.store(param, loaded_weight)

    @staticmethod
    def store(param: nn.Parameter, shard: Loaded, offset: int = 0, loader_args: tuple = ()) -> None:
        """This rank's shard into the parameter, from row offset on; a quantized shard waits for prepack."""
        if not isinstance(shard, torch.Tensor):
            keep_quantized(param, shard, loader_args)
        else:
            param.data.narrow(0, offset, shard.size(0)).copy_(shard)


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank (an MoE router: every rank routes every token the same way)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias, tp_dim=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.weight, self.bias, self.packed_weight)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, divide(output_size, get_tp_group().size), bias, tp_dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x, self.weight, self.bias, self.packed_weight)
        if self.lora is not None:
            self.lora.add(x, y)
        return y

    def output_parts(self) -> dict:
        """Each checkpoint part's rows in the whole output, in order (shard id -> size); one part: None."""
        return {None: self.weight.size(0) * self.tp_size}

    def output_shard(self, shard_id=None) -> OutputShard:
        """Where a part's rows go on this rank: its offset in the rank's output, the first checkpoint row of the
        rank's share of the part, and how many rows (a LoRA B's rows are placed as the weight's)."""
        size = self.weight.size(0)
        return OutputShard(0, self.tp_rank * size, size)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections in one matmul (gate and up); each loads into its slice."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)
        expect_loader_shards(self, [(i,) for i in range(len(output_sizes))])

    def weight_loader(self, param: nn.Parameter, loaded_weight: Loaded, shard_id: int | str) -> None:
        if shard_id == FUSED:
            load_fused(param, loaded_weight, self.output_parts(), self.weight_loader)
            return
        check_weight_shape(loaded_weight, [self.output_sizes[shard_id], *param.shape[1:]])
        offset, start, size = self.output_shard(shard_id)
        self.store(param, take_rows(loaded_weight, start, size), offset, (shard_id,))

    def output_parts(self) -> dict:
        return dict(enumerate(self.output_sizes))

    def output_shard(self, shard_id=None) -> OutputShard:
        size = self.output_sizes[shard_id] // self.tp_size
        return OutputShard(sum(self.output_sizes[:shard_id]) // self.tp_size, self.tp_rank * size, size)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul. With fewer KV heads than ranks, KV heads are replicated."""

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False):
        tp_size = get_tp_group().size
        self.head_dim = head_dim
        self.num_heads = divide(total_num_heads, tp_size)
        if total_num_kv_heads >= tp_size:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size)
            self.num_kv_head_replicas = 1
        else:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp_size, total_num_kv_heads)
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, output_size, bias)
        expect_loader_shards(self, [("q",), ("k",), ("v",)])

    def weight_loader(self, param: nn.Parameter, loaded_weight: Loaded, shard_id: str) -> None:
        if shard_id == FUSED:  # the checkpoint's whole q, k and v (every rank's heads, KV heads once)
            load_fused(param, loaded_weight, self.output_parts(), self.weight_loader)
            return
        check_weight_shape(loaded_weight, [self.output_parts()[shard_id], *param.shape[1:]])
        offset, start, size = self.output_shard(shard_id)
        self.store(param, take_rows(loaded_weight, start, size), offset, (shard_id,))

    def output_parts(self) -> dict:
        total_kv = self.num_kv_heads * self.tp_size // self.num_kv_head_replicas * self.head_dim
        return {"q": self.num_heads * self.head_dim * self.tp_size, "k": total_kv, "v": total_kv}

    def output_shard(self, shard_id=None) -> OutputShard:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            return OutputShard(0, self.tp_rank * q_size, q_size)
        offset = q_size if shard_id == "k" else q_size + kv_size
        return OutputShard(offset, self.tp_rank // self.num_kv_head_replicas * kv_size, kv_size)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial sums are all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(divide(input_size, get_tp_group().size), output_size, bias, tp_dim=1)

    def weight_loader(self, param: nn.Parameter, loaded_weight: Loaded) -> None:
        if param.dim() == 1:  # the bias is whole on every rank: added once, after the reduce
            check_weight_shape(loaded_weight, param.shape)
            param.data.copy_(loaded_weight)
            return
        super().weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x, self.weight, None, self.packed_weight)
        if self.lora is not None:  # on the partial sums: the all-reduce adds the ranks' shares of x @ A
            self.lora.add(x, y)
        self.tp_group.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y
