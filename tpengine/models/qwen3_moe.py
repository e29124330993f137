"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): the Qwen3 decoder (QK-norm, no bias) whose MLP is, in the
sparse layers, a mixture of experts: a router (mlp.gate) scores every expert, the top num_experts_per_tok
run (SiLU-gated MLPs of moe_intermediate_size) and their outputs are summed with the router's softmax
weights, renormalised over the chosen ones when norm_topk_prob. Layers listed in mlp_only_layers, or off
the decoder_sparse_step stride, keep a dense MLP of intermediate_size."""
import re

import torch
from torch import nn

from tpengine.hf_config import HFConfig, is_sparse_layer
from tpengine.layers.fused_moe import FusedMoE
from tpengine.layers.linear import ReplicatedLinear
from tpengine.models.decoder import DecoderFamily, DecoderForCausalLM, GatedMLP

# model.layers.L.mlp.experts.E.gate_proj.weight -> (model.layers.L.mlp.experts, E, gate)
EXPERT_WEIGHT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


class SparseMoeBlock(nn.Module):
    def __init__(self, config: HFConfig):
        super().__init__()
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts)
        self.experts = FusedMoE(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                                config.moe_intermediate_size, renormalize=config.norm_topk_prob)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    @staticmethod
    def family(config: HFConfig) -> DecoderFamily:
        bias = config.attention_bias
        return DecoderFamily(qkv_bias=bias, o_bias=bias, qk_norm=True)

    def make_mlp(self, config: HFConfig, family: DecoderFamily, layer_idx: int) -> nn.Module:
        if is_sparse_layer(config, layer_idx):
            return SparseMoeBlock(config)
        return GatedMLP(config.hidden_size, config.intermediate_size)

    def checkpoint_target(self, name: str) -> tuple[str | None, tuple]:
        expert = EXPERT_WEIGHT.match(name)
        if expert:  # per-expert tensors load into the layer's stacked ones (None: another pipeline stage's)
            prefix, index, shard = expert.groups()
            return self._on_this_stage(f"{prefix}.{'w2' if shard == 'down' else 'w13'}_weight"), (int(index), shard)
        return super().checkpoint_target(name)
