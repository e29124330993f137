"""Qwen3-VL MoE (Qwen3-VL-30B-A3B, Qwen3-VL-235B-A22B): Qwen3-VL (models/qwen3_vl.py: deepstack, interleaved
M-RoPE, its vision tower) whose MLPs are Qwen3-MoE's (models/qwen3_moe.py): in the sparse layers a router
(mlp.gate) picks num_experts_per_tok of num_experts SiLU-gated experts of moe_intermediate_size; layers in
mlp_only_layers, or off the decoder_sparse_step stride, keep a dense MLP of intermediate_size. Its router
(Qwen3VLMoeTextTopKRouter) always renormalises the chosen experts' softmax weights: the config has no norm_topk_prob.

The checkpoint stores each projection of all a layer's experts as one tensor, gate then up in halves (not gpt-oss's
interleaving): transformers 5 writes mlp.experts.gate_up_proj [experts, 2 * moe_intermediate, hidden] and
mlp.experts.down_proj [experts, hidden, moe_intermediate] ([out, in]); the released checkpoints hold them
transposed ([in, out]), which transformers' conversion mapping transposes at load when the shape differs from its
own. Both load here, by the same rule.
"""
import dataclasses
import re

import torch
from torch import nn

from tpengine.hf_config import HFConfig, is_sparse_layer
from tpengine.layers.fused_moe import FusedMoE
from tpengine.layers.linear import FUSED
from tpengine.layers.load_state import Loaded, check_weight_shape
from tpengine.models.decoder import DecoderFamily, GatedMLP
from tpengine.models.qwen3_moe import Qwen3MoeForCausalLM, SparseMoeBlock
from tpengine.models.qwen3_vl import Qwen3VLForConditionalGeneration

# model.layers.L.mlp.experts.gate_up_proj -> (model.layers.L.mlp.experts, gate_up)
STACKED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up|down)_proj$")


class Qwen3VLMoeSparseBlock(SparseMoeBlock):
    """Qwen3-MoE's block, renormalising always, whose experts also load from one tensor per projection."""

    def __init__(self, config: HFConfig):
        super().__init__(dataclasses.replace(config, norm_topk_prob=True))
        for param in (self.experts.w13_weight, self.experts.w2_weight):
            param.load_state.weight_loader = self.load_experts

    def load_experts(self, param: nn.Parameter, loaded_weight: Loaded, *args) -> None:
        """All the experts' gate_up_proj or down_proj (args (FUSED,)), in transformers 5's layout or the released
        checkpoints' transposed one; or one expert's projection (args (expert, shard)), as Qwen3-MoE's load."""
        experts: FusedMoE = self.experts
        if args != (FUSED,):
            experts.weight_loader(param, loaded_weight, *args)
            return
        if not isinstance(loaded_weight, torch.Tensor):
            raise ValueError("experts stored one tensor per projection load float weights only, not quantized ones")
        size, rank, tp = experts.intermediate_per_rank, experts.tp_group.rank, experts.tp_group.size
        down = param is experts.w2_weight
        hidden = experts.w2_weight.size(1)
        expected = [experts.num_experts, hidden, size * tp] if down else [experts.num_experts, 2 * size * tp, hidden]
        transposed = [expected[0], expected[2], expected[1]]  # the released checkpoints' [in, out]
        if transposed != expected and list(loaded_weight.shape) == transposed:  # square: as it is, as transformers
            loaded_weight = loaded_weight.transpose(1, 2)
        check_weight_shape(loaded_weight, expected)
        if down:
            param.data.copy_(loaded_weight.narrow(2, rank * size, size))
            return
        for offset, start in ((0, 0), (size, size * tp)):  # gate: the first half of the rows, up: the second
            param.data.narrow(1, offset, size).copy_(loaded_weight.narrow(1, start + rank * size, size))


class Qwen3VLMoeTextForCausalLM(Qwen3MoeForCausalLM):
    """Qwen3-MoE's MLPs and checkpoint names, plus the stacked expert tensors; below Qwen2.5-VL's class in
    Qwen3VLMoeForConditionalGeneration's MRO, so its checkpoint_target sees the text model's names with the
    multimodal prefixes already mapped (model.language_model.layers... -> model.layers...)."""

    def make_mlp(self, config: HFConfig, family: DecoderFamily, layer_idx: int) -> nn.Module:
        if is_sparse_layer(config, layer_idx):
            return Qwen3VLMoeSparseBlock(config)
        return GatedMLP(config.hidden_size, config.intermediate_size)

    def checkpoint_target(self, name: str) -> tuple[str | None, tuple]:
        stacked = STACKED_EXPERTS.match(name)
        if stacked:  # None: another pipeline stage's layer
            prefix, projection = stacked.groups()
            return self._on_this_stage(f"{prefix}.{'w13' if projection == 'gate_up' else 'w2'}_weight"), (FUSED,)
        return super().checkpoint_target(name)


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration, Qwen3VLMoeTextForCausalLM):
    """Qwen3-VL's model (deepstack, M-RoPE layers, vision tower, checkpoint prefixes, family) with the MLPs of
    Qwen3VLMoeTextForCausalLM: MRO Qwen3VL -> Qwen2.5-VL -> Qwen3VLMoeText -> Qwen3-MoE -> DecoderForCausalLM."""
