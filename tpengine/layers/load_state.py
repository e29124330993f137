"""What loading tracks on a parameter, from the model's build to prepack, in one LoadState: the layer that owns the
parameter attaches it when it builds it (`attach`), the loader reads it (`load_state`), prepack packs from it.

A weight loads either as a float tensor or, where its layer takes one, as a quantized form (a QuantizedWeight, or an
Fp8Weight where the platform multiplies FP8): the weight_loader takes this rank's shard of it. A quantized shard
waits in quantized_parts (keyed by the weight_loader's arguments) until prepack joins and packs the parts; the
packed form is kept here, made once however many modules share the parameter (a tied embedding and LM head).
"""
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from tpengine.quantization.fp8 import Fp8Weight, cat_fp8_rows
from tpengine.quantization.weights import QuantizedWeight, cat_rows

Loaded = torch.Tensor | QuantizedWeight | Fp8Weight  # what a weight loader takes: a float tensor or a quantized one


def check_weight_shape(loaded_weight: Loaded, expected: torch.Size | tuple[int, ...] | list[int]) -> None:
    """ValueError unless a checkpoint tensor has the whole (unsharded) shape the model expects."""
    if tuple(loaded_weight.shape) != tuple(expected):
        raise ValueError(f"its shape is {list(loaded_weight.shape)}, the model expects {list(expected)}")


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    check_weight_shape(loaded_weight, param.shape)
    param.data.copy_(loaded_weight)


@dataclass(eq=False)
class LoadState:
    # (param, loaded, *arguments): this rank's shard of a checkpoint tensor into param
    weight_loader: Callable = default_weight_loader
    takes: tuple[type, ...] = ()  # the quantized forms weight_loader takes besides a float tensor
    # the weight_loader argument tuples whose tensors together fill it (q, k, v; or one FUSED tensor); []: optional
    shards: list[tuple] = field(default_factory=lambda: [()])
    quantized_parts: dict[tuple, QuantizedWeight | Fp8Weight] = field(default_factory=dict)  # until prepack
    run_dtype: torch.dtype | None = None  # the model's dtype, where keep_weights_in allocated it in another
    packed: object = None  # what prepack made of it (a platform's PackedWeight), shared by every module holding it
    prepacked: bool = False

    def takes_form(self, form: type) -> bool:
        """Whether weight_loader takes a loaded weight of this type (a float tensor always)."""
        return issubclass(form, torch.Tensor) or form in self.takes


def attach(param: nn.Parameter, weight_loader: Callable = default_weight_loader, **state) -> LoadState:
    """param's LoadState, made once by the layer that builds param (fields as LoadState's)."""
    param.load_state = LoadState(weight_loader, **state)
    return param.load_state


_PLAIN = LoadState()  # a parameter no layer attached a state to: loaded whole, float only


def load_state(param: nn.Parameter) -> LoadState:
    """param's LoadState, or a plain one (a norm's weight, say: loaded whole, float only, never packed)."""
    return getattr(param, "load_state", _PLAIN)


def keep_quantized(param: nn.Parameter, part: QuantizedWeight | Fp8Weight, loader_args: tuple = ()) -> None:
    """Hold one quantized part of param until prepack (packed_quantized) joins and packs them."""
    param.load_state.quantized_parts[loader_args] = part


def _pack_quantized_parts(param: nn.Parameter, state: LoadState, pack):
    order = state.shards
    parts = state.quantized_parts
    if len(parts) != len(order):  # some parts loaded as floats: one matmul cannot mix them
        raise ValueError(f"a packed weight of shape {list(param.shape)} is quantized in part: its quantized "
                         f"parts are {sorted(parts, key=str)}, it needs all of {order} or none")
    ordered = [parts[args] for args in order]
    whole = (cat_fp8_rows if isinstance(ordered[0], Fp8Weight) else cat_rows)(ordered).to(param.device)
    packed = pack(whole, state.run_dtype or param.dtype)
    param.data = param.data.new_empty(0)
    state.quantized_parts = {}
    return packed


def packed_quantized(param: nn.Parameter, pack):
    """The packed form of a parameter loaded quantized (None if it loaded as floats), packed once however many
    modules share the parameter; the float storage is freed."""
    state = load_state(param)
    if state.quantized_parts:
        state.packed, state.prepacked = _pack_quantized_parts(param, state, pack), True
    return state.packed if state.prepacked else None


def keep_weights_in(model: nn.Module, weight_dtype: torch.dtype) -> None:
    """Before loading: the weights that prepack packs in weight_dtype (packed_as_loaded: the linears' and the embedding
    tables', every module that packs linear weights) are allocated in weight_dtype, so a checkpoint loads into its
    memory, not into the model dtype's (twice as much for bfloat16 weights of a float32 model). Each remembers the
    model's dtype (run_dtype), which it is multiplied in where it is not packed."""
    for module in model.modules():
        param = getattr(module, "weight", None)
        if (hasattr(module, "pack_linear_weight") and isinstance(param, nn.Parameter) and param.is_floating_point()
                and param.load_state.run_dtype is None):  # a tied table once
            param.load_state.run_dtype = param.dtype
            param.data = torch.empty(param.shape, dtype=weight_dtype, device=param.device)


def _packed_in(param: nn.Parameter, state: LoadState, weight_dtype: torch.dtype, pack):
    """The platform's packed copy of a float parameter with its weights kept in weight_dtype (pack_linear_weight), or
    None where it makes none (then the parameter is in its run_dtype again); the float storage freed."""
    packed = pack(param, weight_dtype)
    if packed is not None:
        param.data = param.data.new_empty(0)
    elif state.run_dtype is not None and param.dtype != state.run_dtype:
        param.data = param.data.to(state.run_dtype)
    return packed


def packed_as_loaded(param: nn.Parameter, weight_dtype: torch.dtype | None, pack_quantized, pack_linear):
    """What prepack makes of a parameter before any float packing, once however many modules share it: its
    quantized parts packed, else its weights kept in weight_dtype (packed_in), else None."""
    state = param.load_state
    if not state.prepacked:
        if state.quantized_parts:
            state.packed = _pack_quantized_parts(param, state, pack_quantized)
        elif weight_dtype is not None:
            state.packed = _packed_in(param, state, weight_dtype, pack_linear)
        state.prepacked = True
    return state.packed
