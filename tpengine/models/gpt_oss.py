"""gpt-oss (gpt-oss-20b, gpt-oss-120b): the shared decoder with bias on q, k, v and o, a learned sink logit per
head in every attention softmax, sliding-window (sliding_window, 128) and full layers alternating as layer_types
says, YaRN rotary, and a mixture of experts in every layer. Its router (mlp.router, a linear with bias) keeps
each token's top num_experts_per_tok logits and softmaxes them; each expert is
    down(clamped_swiglu(gate_up(x) + gate_up_bias)) + down_bias
with (up + 1) * gate * sigmoid(swiglu_alpha * gate), gate clamped above at swiglu_limit and up to
[-swiglu_limit, swiglu_limit]. The checkpoint stores each projection of all the experts as one tensor (float,
or MXFP4 blocks and scales: tpengine/quantization/mxfp4.py), which FusedMoE's stacked loader shards; a GGUF file
gives each expert's gate, up and down (MXFP4 blocks run as int8 values) and biases apart."""
import functools
import re

import torch
from torch import nn

from tpengine.hf_config import HFConfig
from tpengine.layers.fused_moe import FusedMoE
from tpengine.layers.linear import FUSED, ReplicatedLinear
from tpengine.models.decoder import DecoderFamily, DecoderForCausalLM
from tpengine.platforms.torch_ops import clamped_swiglu

# model.layers.L.mlp.experts.gate_up_proj_bias -> (model.layers.L.mlp.experts, gate_up, _bias)
EXPERT_TENSOR = re.compile(r"^(.*\.mlp\.experts)\.(gate_up|down)_proj(_bias)?$")
# a GGUF file's one expert: model.layers.L.mlp.experts.E.gate_proj.bias -> (..., E, gate, bias)
ONE_EXPERT_TENSOR = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.(weight|bias)$")


class GptOssMoeBlock(nn.Module):
    def __init__(self, config: HFConfig):
        super().__init__()
        self.router = ReplicatedLinear(config.hidden_size, config.num_experts, bias=True)
        self.experts = FusedMoE(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                                config.intermediate_size, renormalize=False, softmax_after_top_k=True,
                                act_and_mul=functools.partial(clamped_swiglu, alpha=config.swiglu_alpha,
                                                              limit=config.swiglu_limit),
                                bias=True, stacked=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.router(x))


class GptOssForCausalLM(DecoderForCausalLM):
    @staticmethod
    def family(config: HFConfig) -> DecoderFamily:
        bias = config.attention_bias
        return DecoderFamily(qkv_bias=bias, o_bias=bias, sinks=True)

    def make_mlp(self, config: HFConfig, family: DecoderFamily, layer_idx: int) -> nn.Module:
        return GptOssMoeBlock(config)

    def checkpoint_target(self, name: str) -> tuple[str | None, tuple]:
        # None: a tensor of another pipeline stage's layers
        expert = EXPERT_TENSOR.match(name)
        if expert:
            prefix, projection, bias = expert.groups()
            return self._on_this_stage(
                f"{prefix}.{'w13' if projection == 'gate_up' else 'w2'}_{'bias' if bias else 'weight'}"), (FUSED,)
        one = ONE_EXPERT_TENSOR.match(name)
        if one:
            prefix, index, projection, kind = one.groups()
            return self._on_this_stage(f"{prefix}.{'w2' if projection == 'down' else 'w13'}_{kind}"), \
                (int(index), projection)
        if name.endswith((".self_attn.sinks", ".self_attn.sinks.weight")):  # a GGUF file's attn_sinks.weight
            return self._on_this_stage(name.removesuffix(".weight").replace(".self_attn.sinks",
                                                                           ".self_attn.attn.sinks")), ()
        return super().checkpoint_target(name)
