"""Mixture-of-experts MLP: a router picks top-k experts per token; each rank holds every expert's slice.

Tensor parallelism slices each expert's intermediate dimension (gate/up by rows, down by columns),
so a layer ends with one all-reduce, as the dense MLP does. Experts are stacked per layer:
w13 [experts, 2 * intermediate / tp, hidden] (gate then up) and w2 [experts, hidden, intermediate / tp].
"""
import torch
import torch.nn.functional as F
from torch import nn

from tpengine.distributed.parallel_state import divide, get_tp_group
from tpengine.layers.linear import check_weight_shape
from tpengine.platforms import current_platform
from tpengine.platforms.torch_ops import silu_and_mul


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [tokens, top_k] in the logits' dtype, expert ids [tokens, top_k]), as transformers routes:
    softmax in float32, torch.topk (its order and tie-breaking), then renormalised over the chosen k."""
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
    them: grouped by expert on the CPU, Triton's fused kernel on CUDA) and all-reduces."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool):
        super().__init__()
        self.tp_group = get_tp_group()
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.intermediate_per_rank = divide(intermediate_size, self.tp_group.size)
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate_per_rank, hidden_size),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, self.intermediate_per_rank),
                                      requires_grad=False)
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight.weight_loader = self.weight_loader
        self.w13_weight.loader_shards = [(e, shard) for e in range(num_experts) for shard in ("gate", "up")]
        self.w2_weight.loader_shards = [(e, "down") for e in range(num_experts)]
        self.moe_experts = current_platform().moe_experts

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, expert: int, shard: str) -> None:
        """One expert's gate_proj / up_proj ([intermediate, hidden]) or down_proj ([hidden, intermediate])."""
        size, rank = self.intermediate_per_rank, self.tp_group.rank
        whole = size * self.tp_group.size
        hidden = self.w2_weight.size(1)
        check_weight_shape(loaded_weight, [hidden, whole] if shard == "down" else [whole, hidden])
        if shard == "down":
            param.data[expert].copy_(loaded_weight.narrow(1, rank * size, size))
        else:
            offset = 0 if shard == "gate" else size
            param.data[expert].narrow(0, offset, size).copy_(loaded_weight.narrow(0, rank * size, size))

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        out = self.moe_experts(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        self.tp_group.all_reduce(out)
        return out
