"""DeepSeek V2 (V2-Lite, V2, V2.5) and V3 (V3, R1, and Kimi K2, whose checkpoints are V3's): the shared decoder with
multi-head latent attention (layers/latent_attention.py) and DeepSeekMoE: the first first_k_dense_replace layers keep
a dense MLP, the others route each token to num_experts_per_tok of the routed experts and add shared experts (one
gated MLP of n_shared_experts x moe_intermediate_size) that every token runs.

Routing follows transformers' DeepseekV2TopkRouter and DeepseekV3TopkRouter op for op, in float32 from a float32
router weight (gate.weight, kept float32 as transformers keeps it):
- V2: softmax scores; the top k ("greedy"), or the top k within the topk_group groups of highest maximum score
  ("group_limited_greedy"); weights times routed_scaling_factor (V2's norm_topk_prob is read by nothing).
- V3: sigmoid scores; choice scores add e_score_correction_bias; the topk_group groups with the highest sums of
  their top two choice scores keep their experts; the top k of those by choice score, weighted by their plain
  scores, normalised when norm_topk_prob, times routed_scaling_factor.
V3's multi-token-prediction layer (model.layers.<num_hidden_layers>...) is skipped by the model; speculative decoding
with method "mtp" loads it as DeepseekMtp, its drafter (runner/mtp_drafter.py).
"""
import re

import torch
import torch.nn.functional as F
from torch import nn

from tpengine.attention.metadata import AttentionMetadata
from tpengine.hf_config import HFConfig, is_sparse_layer
from tpengine.layers.layernorm import RMSNorm
from tpengine.layers.linear import ReplicatedLinear
from tpengine.layers.fused_moe import FusedMoE
from tpengine.layers.latent_attention import LatentAttention
from tpengine.models.decoder import DecoderFamily, DecoderForCausalLM, DecoderLayer, GatedMLP
from tpengine.models.qwen3_moe import EXPERT_WEIGHT

LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def route_v2(scores_logits: torch.Tensor, top_k: int, method: str, num_groups: int | None, top_groups: int | None,
             scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepseekV2TopkRouter's (weights, expert ids) from float32 router logits."""
    scores = scores_logits.softmax(dim=-1, dtype=torch.float32)
    if method == "group_limited_greedy":
        group_scores = scores.view(-1, num_groups, scores.size(-1) // num_groups).max(dim=-1).values
        scores = scores.masked_fill(~_kept_experts(group_scores, top_groups, scores.size(-1)), 0.0)
    weights, ids = torch.topk(scores, k=top_k, dim=-1, sorted=False)
    return weights * scaling, ids


def route_v3(scores_logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, num_groups: int,
             top_groups: int, normalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepseekV3TopkRouter's (weights, expert ids) from float32 router logits."""
    num_experts = scores_logits.size(-1)
    scores = scores_logits.sigmoid()
    choice = scores + correction_bias
    group_scores = choice.view(-1, num_groups, num_experts // num_groups).topk(2, dim=-1)[0].sum(dim=-1)
    choice = choice.masked_fill(~_kept_experts(group_scores, top_groups, num_experts), float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if normalize:
        weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
    return weights * scaling, ids


def _kept_experts(group_scores: torch.Tensor, top_groups: int, num_experts: int) -> torch.Tensor:
    """[tokens, experts] bool: the experts of each token's top_groups groups."""
    num_groups = group_scores.size(-1)
    group_idx = torch.topk(group_scores, k=top_groups, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    return group_mask.unsqueeze(-1).expand(-1, num_groups, num_experts // num_groups).reshape(-1, num_experts).bool()


class DeepseekRouter(nn.Module):
    """gate.weight [experts, hidden] in float32 on every rank (and V3's e_score_correction_bias [experts])."""

    def __init__(self, config: HFConfig):
        super().__init__()
        self.config = config
        self.v3 = config.model_type == "deepseek_v3"
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size, dtype=torch.float32),
                                   requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.num_experts, dtype=torch.float32),
                                                    requires_grad=False) if self.v3 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        if self.v3:
            return route_v3(logits, self.e_score_correction_bias, c.num_experts_per_tok, c.n_group, c.topk_group,
                            c.norm_topk_prob, c.routed_scaling_factor)
        return route_v2(logits, c.num_experts_per_tok, c.topk_method, c.n_group, c.topk_group,
                        c.routed_scaling_factor)


class DeepseekMoE(nn.Module):
    def __init__(self, config: HFConfig):
        super().__init__()
        self.gate = DeepseekRouter(config)
        self.experts = FusedMoE(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                                config.moe_intermediate_size, renormalize=False, routing=self.gate.select)
        self.shared_experts = GatedMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts,
                                       bias=config.mlp_bias) if config.n_shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class DeepseekDecoderLayer(DecoderLayer):
    attention_class = LatentAttention


class DeepseekV2ForCausalLM(DecoderForCausalLM):
    layer_class = DeepseekDecoderLayer

    def __init__(self, config: HFConfig, backend):
        self.num_hidden_layers = config.num_hidden_layers
        super().__init__(config, backend)

    @staticmethod
    def family(config: HFConfig) -> DecoderFamily:
        return DecoderFamily(mlp_bias=config.mlp_bias)

    def make_mlp(self, config: HFConfig, family: DecoderFamily, layer_idx: int) -> nn.Module:
        if is_sparse_layer(config, layer_idx):
            return DeepseekMoE(config)
        return GatedMLP(config.hidden_size, config.intermediate_size, bias=family.mlp_bias)

    def checkpoint_target(self, name: str) -> tuple[str | None, tuple]:
        layer = LAYER_INDEX.match(name)
        if layer and int(layer.group(1)) >= self.num_hidden_layers:
            return None, ()  # a multi-token-prediction layer: not served
        expert = EXPERT_WEIGHT.match(name)
        if expert:  # per-expert tensors load into the layer's stacked ones (None: another pipeline stage's)
            prefix, index, shard = expert.groups()
            return self._on_this_stage(f"{prefix}.{'w2' if shard == 'down' else 'w13'}_weight"), (int(index), shard)
        if ".self_attn." in name:  # MLA's projections are its own, never the packed q/k/v (V2-Lite's q_proj)
            return self._on_this_stage(name), ()
        return super().checkpoint_target(name)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    pass


# the MTP layer's own tensors (model.layers.<N>.<name>) -> ours; its decoder layer's go under block.
MTP_OWN = {"enorm.": "enorm.", "hnorm.": "hnorm.", "eh_proj.": "eh_proj.", "shared_head.norm.": "shared_head_norm."}


class DeepseekMtp(nn.Module):
    """DeepSeek V3's multi-token-prediction layer: from the model's final (normed) hidden state at position p and the
    embedding of token p + 1, a guess at token p + 2:
        h = block(eh_proj([enorm(embed(token)), hnorm(hidden)]))   (a decoder layer: MLA, then DeepSeekMoE)
        logits = lm_head(shared_head_norm(h))
    h also stands in for the model's hidden state when it guesses further (vLLM's reuse of one layer for several
    drafts). The embedding and LM head are the model's (share_with): the checkpoint's copies are not read."""

    def __init__(self, config: HFConfig, backend):
        super().__init__()
        self.index = config.num_hidden_layers  # its tensors' layer number in the checkpoint
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm, self.hnorm = RMSNorm(hidden, eps=eps), RMSNorm(hidden, eps=eps)
        self.eh_proj = ReplicatedLinear(2 * hidden, hidden)
        mlp = DeepseekMoE(config) if config.num_experts else GatedMLP(hidden, config.intermediate_size)
        self.block = DeepseekDecoderLayer(config, DecoderFamily(), backend, mlp, self.index)
        self.shared_head_norm = RMSNorm(hidden, eps=eps)
        self.embed_tokens = self.lm_head = None

    def share_with(self, model: DeepseekV2ForCausalLM) -> None:
        """The model's embedding and LM head, as DeepSeek's MTP layer shares them."""
        self.embed_tokens, self.lm_head = model.model.embed_tokens, model.lm_head

    def checkpoint_target(self, name: str) -> tuple[str | None, tuple]:
        prefix = f"model.layers.{self.index}."
        if not name.startswith(prefix):
            return None, ()  # the model's own tensors, and another MTP layer's
        rest = name.removeprefix(prefix)
        for theirs, ours in MTP_OWN.items():
            if rest.startswith(theirs):
                return ours + rest.removeprefix(theirs), ()
        if rest.startswith(("embed_tokens.", "shared_head.head.")):
            return None, ()  # copies of the model's embedding and head
        expert = EXPERT_WEIGHT.match("." + rest)
        if expert:
            _, index, shard = expert.groups()
            return f"block.mlp.experts.{'w2' if shard == 'down' else 'w13'}_weight", (int(index), shard)
        for projection, shard in (("gate_proj", 0), ("up_proj", 1)):
            if f".{projection}." in rest and rest.startswith("mlp."):
                return "block." + rest.replace(f".{projection}.", ".gate_up_proj."), (shard,)
        return "block." + rest, ()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                previous_hidden: torch.Tensor) -> torch.Tensor:
        """Each row's h (before shared_head_norm): row i holds token p + 1 at position p, previous_hidden[i] the
        model's hidden state at p."""
        embeds = self.embed_tokens(input_ids)
        embeds = embeds.masked_fill((positions == 0)[:, None], 0.0)  # vLLM's: the first position has no before
        hidden = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(previous_hidden.contiguous())], dim=-1))
        hidden, residual = self.block(positions, hidden, None, meta)
        return hidden + residual

    def compute_logits(self, hidden: torch.Tensor, num_rows: int) -> torch.Tensor:
        """This rank's slice of the vocabulary's logits (ParallelLMHead, gather=False)."""
        return self.lm_head(self.shared_head_norm(hidden), False, num_rows)
