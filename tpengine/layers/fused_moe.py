"""Mixture-of-experts MLP: a router picks top-k experts per token; each rank holds every expert's slice.

Tensor parallelism slices each expert's intermediate dimension (gate/up by rows, down by columns),
so a layer ends with one all-reduce, as the dense MLP does. Experts are stacked per layer:
w13 [experts, 2 * intermediate / tp, hidden] (gate then up) and w2 [experts, hidden, intermediate / tp],
with biases where the family has them (gpt-oss): w13_bias [experts, 2 * intermediate / tp] and w2_bias
[experts, hidden], whole on every rank and added by rank 0 alone, before the all-reduce.

Checkpoints store experts one of two ways, and each weight_loader takes its own: one tensor per expert and
projection (Qwen3-MoE: experts.E.gate_proj.weight [intermediate, hidden]), or one per projection for all the
experts (gpt-oss: experts.gate_up_proj [experts, hidden, 2 * intermediate], gate and up interleaved column by
column, and experts.down_proj [experts, intermediate, hidden], both [in, out]).
"""
import torch
import torch.nn.functional as F
from torch import nn

from tpengine.distributed.parallel_state import divide, get_tp_group
from tpengine.layers.batch_invariant import is_building_batch_invariant, row_tiled_experts
from tpengine.layers.linear import FUSED, take_rows
from tpengine.layers.load_state import Loaded, attach, check_weight_shape, keep_quantized
from tpengine.platforms import current_platform
from tpengine.platforms.packed import packed_linear
from tpengine.platforms.torch_ops import grouped_experts, silu_and_mul
from tpengine.quantization.weights import QuantizedWeight, cat_rows


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                   softmax_after_top_k: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [tokens, top_k] in the logits' dtype, expert ids [tokens, top_k]), as transformers routes:
    softmax in float32, torch.topk (its order and tie-breaking), then renormalised over the chosen k; or, with
    softmax_after_top_k (gpt-oss), torch.topk of the logits, then a softmax over the chosen k in their dtype."""
    if softmax_after_top_k:
        top_logits, ids = torch.topk(router_logits, top_k, dim=-1)
        return torch.softmax(top_logits, dim=-1, dtype=top_logits.dtype), ids
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def per_token_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor) -> torch.Tensor:
    """The experts' sum, one token and one expert at a time: the reference the platforms' grouped and fused
    paths (torch_ops.grouped_experts, Triton's fused_experts) are measured against."""
    out = torch.zeros_like(x)
    for t in range(x.size(0)):
        for k in range(topk_ids.size(1)):
            expert = int(topk_ids[t, k])
            h = silu_and_mul(F.linear(x[t:t + 1], w13[expert]))
            out[t] += (F.linear(h, w2[expert]) * topk_weights[t, k])[0]
    return out


class FusedMoE(nn.Module):
    """Experts of one layer, stacked; forward(x, router_logits) routes, runs the experts (as its platform runs
    them: grouped by expert on the CPU, Triton's fused kernel on CUDA) and all-reduces.

    softmax_after_top_k: select_experts' routing. act_and_mul: the activation between the matmuls, over gate
    then up packed in the last dimension (None: silu(gate) * up). bias: the experts have biases. stacked: the
    checkpoint stores one tensor per projection for all the experts (gpt-oss), which loads float only. routing: the
    family's own choice, router logits -> (weights, expert ids) as select_experts returns them (DeepSeek's groups),
    in place of select_experts."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
                 *, softmax_after_top_k: bool = False, act_and_mul=None, bias: bool = False, stacked: bool = False,
                 routing=None):
        super().__init__()
        self.routing = routing
        self.tp_group = get_tp_group()
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.softmax_after_top_k = softmax_after_top_k
        self.act_and_mul = act_and_mul
        self.intermediate_per_rank = divide(intermediate_size, self.tp_group.size)
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate_per_rank, hidden_size),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, self.intermediate_per_rank),
                                      requires_grad=False)
        self.w13_bias = self.w2_bias = None
        if bias:
            self.w13_bias = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate_per_rank), requires_grad=False)
            self.w2_bias = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        assert stacked or not bias, "per-expert checkpoints with expert biases: no family has them"
        gate_up = [(e, shard) for e in range(num_experts) for shard in ("gate", "up")]
        down = [(e, "down") for e in range(num_experts)]
        # a stacking family's checkpoint fills each parameter with one tensor (FUSED); its GGUF files, per expert
        loader = self.any_layout_loader if stacked else self.weight_loader
        attach(self.w13_weight, loader, takes=(QuantizedWeight,), shards=gate_up)
        attach(self.w2_weight, loader, takes=(QuantizedWeight,), shards=down)
        if bias:
            attach(self.w13_bias, loader, shards=gate_up)
            attach(self.w2_bias, loader, shards=down)
        platform = current_platform()
        # batch_invariant: grouped by expert in torch, every expert's rows in fixed tiles (layers/batch_invariant.py)
        self.batch_invariant = is_building_batch_invariant()
        self.moe_experts = self._batch_invariant_experts if self.batch_invariant else platform.moe_experts
        self.pack_quantized_experts = platform.pack_quantized_experts
        self.pack_float_experts = platform.pack_float_experts
        self.packed_experts = None  # quantized: (w13, w2) as the platform's pack_quantized_experts made them

    def weight_loader(self, param: nn.Parameter, loaded_weight: Loaded, expert: int, shard: str) -> None:
        """One expert's gate_proj / up_proj ([intermediate, hidden]) or down_proj ([hidden, intermediate])."""
        size, rank, tp = self.intermediate_per_rank, self.tp_group.rank, self.tp_group.size
        hidden = self.w2_weight.size(1)
        check_weight_shape(loaded_weight, [hidden, size * tp] if shard == "down" else [size * tp, hidden])
        if isinstance(loaded_weight, QuantizedWeight):
            part = loaded_weight.columns(rank * size, size, tp) if shard == "down" else \
                loaded_weight.rows(rank * size, size)
            keep_quantized(param, part, (expert, shard))
        elif shard == "down":
            param.data[expert].copy_(loaded_weight.narrow(1, rank * size, size))
        else:
            offset = 0 if shard == "gate" else size
            param.data[expert].narrow(0, offset, size).copy_(take_rows(loaded_weight, rank * size, size))

    def any_layout_loader(self, param: nn.Parameter, loaded_weight: Loaded, *args) -> None:
        """A stacking family's loader: all the experts' tensor of one projection (args (FUSED,)), or one expert's
        projection or bias (args (expert, shard): a GGUF file's, gate and up apart)."""
        if args == (FUSED,):
            self.stacked_weight_loader(param, loaded_weight)
        elif param is self.w13_bias or param is self.w2_bias:
            self.bias_loader(param, loaded_weight, *args)
        else:
            self.weight_loader(param, loaded_weight, *args)

    def bias_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, expert: int, shard: str) -> None:
        """One expert's gate, up ([intermediate]: this rank's slice) or down ([hidden]: whole) bias."""
        size, rank, tp = self.intermediate_per_rank, self.tp_group.rank, self.tp_group.size
        if shard == "down":
            check_weight_shape(loaded_weight, [self.w2_weight.size(1)])
            param.data[expert].copy_(loaded_weight)
            return
        check_weight_shape(loaded_weight, [size * tp])
        param.data[expert].narrow(0, 0 if shard == "gate" else size, size).copy_(
            loaded_weight.narrow(0, rank * size, size))

    def stacked_weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """All the experts' gate_up_proj [experts, hidden, 2 * intermediate] or down_proj [experts, intermediate,
        hidden] ([in, out], gate and up interleaved column by column), or their biases [experts, 2 *
        intermediate] and [experts, hidden]: this rank's slice of the intermediate dimension, gate then up."""
        if not isinstance(loaded_weight, torch.Tensor):
            raise ValueError("experts stored one tensor per projection load float weights only, not quantized ones")
        size, rank, tp = self.intermediate_per_rank, self.tp_group.rank, self.tp_group.size
        experts, hidden = self.num_experts, self.w2_weight.size(1)
        if param is self.w2_bias:
            check_weight_shape(loaded_weight, [experts, hidden])
            param.data.copy_(loaded_weight)
            return
        if param is self.w2_weight:  # [experts, intermediate, hidden] -> this rank's [experts, hidden, size]
            check_weight_shape(loaded_weight, [experts, size * tp, hidden])
            param.data.copy_(loaded_weight.narrow(1, rank * size, size).transpose(1, 2))
            return
        is_bias = param is self.w13_bias
        check_weight_shape(loaded_weight, [experts, 2 * size * tp] if is_bias else [experts, hidden, 2 * size * tp])
        for offset, first in ((0, 0), (size, 1)):  # gate: the even columns, up: the odd ones
            part = loaded_weight[..., first::2].narrow(-1, rank * size, size)
            param.data.narrow(1, offset, size).copy_(part if is_bias else part.transpose(1, 2))

    def prepack(self, weight_dtype: torch.dtype | None = None) -> None:
        """After loading: quantized experts (gate and up joined) packed as the platform runs them (CUDA: stacked for
        the fused kernel), their floats freed. Float experts stay in the model's dtype whatever weight_dtype, packed
        where the platform has a faster form for them (the CPU's bfloat16 kernel), else multiplied as they are."""
        w13_parts, w2_parts = self.w13_weight.load_state.quantized_parts, self.w2_weight.load_state.quantized_parts
        if not w13_parts and not w2_parts:  # float experts: packed where the platform multiplies a pack faster
            self.packed_experts = self.pack_float_experts(self.w13_weight.data, self.w2_weight.data)
            if self.packed_experts is not None:
                for param in (self.w13_weight, self.w2_weight):
                    param.data = param.data.new_empty(0)
            return
        if len(w13_parts) + len(w2_parts) != 3 * self.num_experts:
            raise ValueError(f"the experts of one layer are quantized in part: {len(w13_parts) + len(w2_parts)} "
                             f"of their {3 * self.num_experts} projections are, and one matmul cannot mix them")
        device, dtype = self.w13_weight.device, self.w13_weight.dtype
        self.packed_experts = self.pack_quantized_experts(
            [cat_rows([w13_parts[(e, "gate")], w13_parts[(e, "up")]]).to(device) for e in range(self.num_experts)],
            [w2_parts[(e, "down")].to(device) for e in range(self.num_experts)], dtype)
        for param in (self.w13_weight, self.w2_weight):
            param.data = param.data.new_empty(0)
            param.load_state.quantized_parts = {}

    @staticmethod
    def _batch_invariant_experts(x, w13, w2, topk_weights, topk_ids, act_and_mul=None, w13_bias=None,
                                 w2_bias=None) -> torch.Tensor:
        if not (isinstance(w13, list) or isinstance(w13, torch.Tensor)):
            raise ValueError("batch_invariant does not cover experts packed for a fused kernel (quantized experts "
                             "on CUDA); run them unquantized or without batch_invariant")
        linear = row_tiled_experts(packed_linear if isinstance(w13, list) else F.linear)
        return grouped_experts(x, w13, w2, topk_weights, topk_ids, act_and_mul or silu_and_mul, linear=linear,
                               w13_bias=w13_bias, w2_bias=w2_bias)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        if self.routing is not None:
            topk_weights, topk_ids = self.routing(router_logits)
            topk_weights = topk_weights.to(x.dtype)
        else:
            topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize,
                                                    self.softmax_after_top_k)
        w13, w2 = self.packed_experts if self.packed_experts is not None else (self.w13_weight, self.w2_weight)
        if self.w13_bias is not None:
            # the down bias once, from rank 0: the all-reduce adds the ranks' partial sums
            out = self.moe_experts(x, w13, w2, topk_weights, topk_ids, self.act_and_mul, w13_bias=self.w13_bias,
                                   w2_bias=self.w2_bias if self.tp_group.rank == 0 else None)
        else:
            out = self.moe_experts(x, w13, w2, topk_weights, topk_ids, self.act_and_mul)
        self.tp_group.all_reduce(out)
        return out
