"""Linear layers that shard across the tensor-parallel group; each parameter loads its own shard. They
multiply through their platform's linear: on the CPU, on a copy of the weight packed once after loading.

A weight loads either as a float tensor, as a QuantizedWeight (a quantized checkpoint's, or a float one's
quantized at load) or as an Fp8Weight (where the platform multiplies FP8): the same shard of rows or columns is
taken of each. A quantized weight's parts wait
on the parameter (`quantized_parts`, keyed by the loader arguments) until prepack joins and packs them.
"""
import torch
from torch import nn

from tpengine.distributed.parallel_state import divide, get_tp_group
from tpengine.platforms import current_platform
from tpengine.quantization.fp8 import Fp8Weight, cat_fp8_rows
from tpengine.quantization.weights import QuantizedWeight, cat_rows

Loaded = torch.Tensor | QuantizedWeight | Fp8Weight  # what a weight loader takes: a float tensor or a quantized one
# the shard id of a checkpoint tensor that holds every part of a packed parameter at once, in order (Phi-3's
# qkv_proj and gate_up_proj): its loader splits it and loads each part as the split checkpoints' are loaded
FUSED = "fused"


def check_weight_shape(loaded_weight: torch.Tensor, expected: torch.Size | tuple[int, ...] | list[int]) -> None:
    """ValueError unless a checkpoint tensor has the whole (unsharded) shape the model expects."""
    if tuple(loaded_weight.shape) != tuple(expected):
        raise ValueError(f"its shape is {list(loaded_weight.shape)}, the model expects {list(expected)}")


def take_rows(loaded: Loaded, start: int, size: int) -> Loaded:
    return loaded.narrow(0, start, size) if isinstance(loaded, torch.Tensor) else loaded.rows(start, size)


def keep_quantized(param: nn.Parameter, part: QuantizedWeight | Fp8Weight, loader_args: tuple = ()) -> None:
    """Hold one quantized part of param until prepack (packed_quantized) joins and packs them."""
    if not hasattr(param, "quantized_parts"):
        param.quantized_parts = {}
    param.quantized_parts[loader_args] = part


def packed_quantized(param: nn.Parameter, pack):
    """The packed form of a parameter loaded quantized (None if it loaded as floats), packed once however
    many modules share the parameter (a tied embedding and LM head); the float storage is freed."""
    parts = getattr(param, "quantized_parts", None)
    if not parts and not hasattr(param, "packed_quantized"):
        return None
    if not hasattr(param, "packed_quantized"):
        order = getattr(param, "loader_shards", [()])
        if len(parts) != len(order):  # some parts loaded as floats: one matmul cannot mix them
            raise ValueError(f"a packed weight of shape {list(param.shape)} is quantized in part: its quantized "
                             f"parts are {sorted(parts, key=str)}, it needs all of {order} or none")
        ordered = [parts[args] for args in order]
        whole = (cat_fp8_rows if isinstance(ordered[0], Fp8Weight) else cat_rows)(ordered).to(param.device)
        param.packed_quantized = pack(whole, getattr(param, "run_dtype", param.dtype))
        param.data = param.data.new_empty(0)
        del param.quantized_parts
    return param.packed_quantized


def keep_weights_in(model: nn.Module, weight_dtype: torch.dtype) -> None:
    """Before loading: the weights that prepack packs in weight_dtype (packed_in: the linears' and the embedding
    tables', every module that packs linear weights) are allocated in weight_dtype, so a checkpoint loads into its
    memory, not into the model dtype's (twice as much for bfloat16 weights of a float32 model). Each remembers the
    model's dtype (run_dtype), which it is multiplied in where it is not packed."""
    for module in model.modules():
        param = getattr(module, "weight", None)
        if (hasattr(module, "pack_linear_weight") and isinstance(param, nn.Parameter) and param.is_floating_point()
                and not hasattr(param, "run_dtype")):  # a tied table once
            param.run_dtype = param.dtype
            param.data = torch.empty(param.shape, dtype=weight_dtype, device=param.device)


def packed_in(param: nn.Parameter, weight_dtype: torch.dtype, pack):
    """The platform's packed copy of a float parameter with its weights kept in weight_dtype (pack_linear_weight), or
    None where it makes none (then the parameter is in its run_dtype again); packed once however many modules share
    the parameter (a tied embedding and LM head), and the float storage freed."""
    if not hasattr(param, "packed_in_weight_dtype"):
        param.packed_in_weight_dtype = pack(param, weight_dtype)
        if param.packed_in_weight_dtype is not None:
            param.data = param.data.new_empty(0)
        elif param.dtype != getattr(param, "run_dtype", param.dtype):
            param.data = param.data.to(param.run_dtype)
    return param.packed_in_weight_dtype


def packed_as_loaded(param: nn.Parameter, weight_dtype: torch.dtype | None, pack_quantized, pack_linear):
    """What prepack makes of a parameter before any float packing: its quantized parts packed (packed_quantized), else
    its weights kept in weight_dtype (packed_in), else None."""
    packed = packed_quantized(param, pack_quantized)
    if packed is None and weight_dtype is not None:
        packed = packed_in(param, weight_dtype, pack_linear)
    return packed


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
        param.loader_shards = shards


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None):
        super().__init__()
        self.tp_dim = tp_dim
        self.tp_group = get_tp_group()
        self.tp_rank = self.tp_group.rank
        self.tp_size = self.tp_group.size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.weight.takes_quantized = True  # the loader may hand its weight_loader a QuantizedWeight
        self.weight.takes_fp8 = True  # and, where the platform multiplies FP8, an Fp8Weight
        platform = current_platform()
        self.pack_linear_weight, self.linear = platform.pack_linear_weight, platform.linear
        self.pack_quantized_weight = platform.pack_quantized_weight
        self.packed_weight = None

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
        return self.linear(x, self.weight, self.bias, self.packed_weight)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections in one matmul (gate and up); each loads into its slice."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)
        expect_loader_shards(self, [(i,) for i in range(len(output_sizes))])

    def weight_loader(self, param: nn.Parameter, loaded_weight: Loaded, shard_id: int | str) -> None:
        if shard_id == FUSED:
            load_fused(param, loaded_weight, dict(enumerate(self.output_sizes)), self.weight_loader)
            return
        check_weight_shape(loaded_weight, [self.output_sizes[shard_id], *param.shape[1:]])
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        self.store(param, take_rows(loaded_weight, self.tp_rank * size, size), offset, (shard_id,))


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
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard_id == FUSED:  # the checkpoint's whole q, k and v (every rank's heads, KV heads once)
            total_kv = self.num_kv_heads * self.tp_size // self.num_kv_head_replicas * self.head_dim
            load_fused(param, loaded_weight, {"q": q_size * self.tp_size, "k": total_kv, "v": total_kv},
                       self.weight_loader)
            return
        num_heads = self.num_heads * self.tp_size if shard_id == "q" else \
            self.num_kv_heads * self.tp_size // self.num_kv_head_replicas
        check_weight_shape(loaded_weight, [num_heads * self.head_dim, *param.shape[1:]])
        if shard_id == "q":
            offset, size, shard_rank = 0, q_size, self.tp_rank
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, shard_rank = kv_size, self.tp_rank // self.num_kv_head_replicas
        self.store(param, take_rows(loaded_weight, shard_rank * size, size), offset, (shard_id,))


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
        self.tp_group.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y
