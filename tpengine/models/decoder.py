"""The decoder every supported family shares, built from tensor-parallel layers; it never mentions ranks.

    embed -> N x [RMSNorm -> attention (q/k/v, rotary, o; the layer's sliding window) -> + residual
                  RMSNorm -> gated SiLU MLP (or experts)   -> + residual] -> RMSNorm -> LM head

A classifier (*ForSequenceClassification, or a causal LM read with classifier_from_token) ends in a classification
head instead, which rank 0's pooler applies to each prompt's last hidden state.

The families differ in a few properties (DecoderFamily); each model file states its own and
documents its architecture, and may bring its own decoder layer (Gemma's norms around attention and MLP).
"""
from dataclasses import dataclass

import torch
from torch import nn

from tpengine.attention.backend import AttentionBackend
from tpengine.attention.metadata import AttentionMetadata
from tpengine.distributed.parallel_state import get_pipeline_stage
from tpengine.hf_config import HFConfig, head_dim_of, layer_sliding_window, max_positions_of, rope_parameters_of
from tpengine.layers.activation import SiluAndMul
from tpengine.layers.attention import Attention, kv_scale_target
from tpengine.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from tpengine.layers.layernorm import RMSNorm
from tpengine.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear,
                                    RowParallelLinear)
from tpengine.layers.rotary_embedding import get_rope


@dataclass(frozen=True)
class DecoderFamily:
    qkv_bias: bool = False   # bias on the q, k and v projections
    o_bias: bool = False     # bias on the attention output projection
    mlp_bias: bool = False   # bias on gate, up and down projections
    qk_norm: bool = False    # RMSNorm over each head's queries and keys, before the rotary embedding
    norm: type[nn.Module] = RMSNorm          # every norm's class (Gemma's scales by 1 + weight)
    activation: type[nn.Module] = SiluAndMul  # the gated MLP's act(gate) * up
    attention_scale: float | None = None     # the attention scores' scale; None: head_dim ** -0.5
    attn_logit_softcap: float | None = None  # scores become c * tanh(scores / c) before the softmax
    embed_scale: float | None = None         # the embedding's rows scaled by it, in the model's dtype
    final_logit_softcap: float | None = None  # logits become c * tanh(logits / c)
    sinks: bool = False      # a learned sink logit per head in the attention softmax (gpt-oss)


class DecoderAttention(nn.Module):
    def __init__(self, config: HFConfig, family: DecoderFamily, backend: AttentionBackend, layer_idx: int):
        super().__init__()
        head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=family.qkv_bias)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.head_split = [self.num_heads, self.num_kv_heads, self.num_kv_heads]
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size, bias=family.o_bias)
        if family.qk_norm:
            self.q_norm = family.norm(head_dim, eps=config.rms_norm_eps)
            self.k_norm = family.norm(head_dim, eps=config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # each layer its own rope: Gemma 3's sliding layers have their own base
        self.rotary_emb = get_rope(head_dim, max_positions_of(config), rope_parameters_of(config, layer_idx))
        scale = family.attention_scale if family.attention_scale is not None else head_dim ** -0.5
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, scale, backend,
                              sliding_window=layer_sliding_window(config, layer_idx),
                              logit_softcap=family.attn_logit_softcap, has_sinks=family.sinks)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, meta: AttentionMetadata):
        # [tokens, q | k | v] as heads, then split by heads: two view ops, where Tensor.split and three views cost
        # ~10 us more a layer on the CPU at decode sizes
        qkv = self.qkv_proj(hidden_states).view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = torch.split_with_sizes(qkv, self.head_split, dim=1)
        q, k = self.rotary_emb(positions, q, k, self.q_norm, self.k_norm)  # q/k norm first, where the family has it
        out = self.attn(q, k, v, meta)
        return self.o_proj(out.flatten(1, -1))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), act SiLU unless told; gate and up in one column-parallel matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 activation: type[nn.Module] = SiluAndMul):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = activation()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    attention_class = DecoderAttention  # (config, family, backend, layer_idx) -> the layer's self_attn

    def __init__(self, config: HFConfig, family: DecoderFamily, backend: AttentionBackend, mlp: nn.Module,
                 layer_idx: int):
        super().__init__()
        self.self_attn = self.attention_class(config, family, backend, layer_idx)
        self.mlp = mlp
        self.input_layernorm = family.norm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = family.norm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions, hidden_states, residual, meta: AttentionMetadata):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, meta)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class DecoderModel(nn.Module):
    """The layers of this rank's pipeline stage (all of them without pipeline parallelism): the embedding on
    the first stage, the final norm on the last; another stage's layers are empty placeholders."""

    def __init__(self, config: HFConfig, family: DecoderFamily, backend: AttentionBackend, make_mlp,
                 layer_class: type[DecoderLayer] = DecoderLayer):
        super().__init__()
        self.stage = stage = get_pipeline_stage()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size) if stage.is_first else None
        # a float32 tensor rounded to the model's dtype as it scales, as transformers keeps it
        self.register_buffer("embed_scale", None if family.embed_scale is None else
                             torch.tensor(family.embed_scale, dtype=torch.float32), persistent=False)
        self.layers = nn.ModuleList([layer_class(config, family, backend, make_mlp(config, family, i), i)
                                     if stage.holds(i) else nn.Module() for i in range(config.num_hidden_layers)])
        self.norm = family.norm(config.hidden_size, eps=config.rms_norm_eps) if stage.is_last else None

    def forward(self, input_ids, positions, meta: AttentionMetadata, from_previous_stage: torch.Tensor | None = None,
                replaced_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The last stage's final hidden states; an earlier stage's hidden states and residual, stacked
        [2, tokens, hidden] for the next (which passes them in as from_previous_stage). replaced_embeddings: (rows,
        vectors) that those rows take as their embeddings (an image's placeholders: its vision tower's output)."""
        stage = self.stage
        if stage.is_first:
            hidden_states = self.embed_tokens(input_ids)
            if self.embed_scale is not None:
                hidden_states = hidden_states * self.embed_scale.to(hidden_states.dtype)
            if replaced_embeddings is not None:
                rows, vectors = replaced_embeddings
                hidden_states = hidden_states.index_copy(0, rows, vectors.to(hidden_states.dtype))
            residual = None
        else:
            hidden_states, residual = from_previous_stage[0], from_previous_stage[1]
        for layer in self.layers[stage.start_layer:stage.end_layer]:
            hidden_states, residual = layer(positions, hidden_states, residual, meta)
        if not stage.is_last:
            return torch.stack([hidden_states, residual])
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class DecoderForCausalLM(nn.Module):
    """The causal LM every family file subclasses: it says its family and, if it must, its MLP or layer."""

    layer_class = DecoderLayer
    model_class = DecoderModel  # the layers' stack (Qwen3-VL's adds image features to its first layers' rows)

    # checkpoint name -> (our packed parameter, its shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: HFConfig, backend: AttentionBackend):
        super().__init__()
        family = self.family(config)
        self.model = self.model_class(config, family, backend, self.make_mlp, self.layer_class)
        self.final_logit_softcap = family.final_logit_softcap
        self.stage = stage = self.model.stage
        self.tie_word_embeddings = config.tie_word_embeddings
        # a classification checkpoint has no LM head; classifier_from_token reads the head's rows (classify_from_tokens)
        classifier_checkpoint = config.is_classifier and config.classifier_from_token is None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size) \
            if stage.is_last and not classifier_checkpoint else None
        if self.lm_head is not None and config.tie_word_embeddings and stage.is_first:
            self.lm_head.weight = self.model.embed_tokens.weight  # one tensor: the checkpoint's embedding serves both
        # transformers' XForSequenceClassification.score: [num_labels, hidden], no bias, on every rank
        self.score = ReplicatedLinear(config.hidden_size, config.num_labels) \
            if classifier_checkpoint and stage.is_last else None
        self.token_classifier: torch.Tensor | None = None  # classify_from_tokens' rows

    @staticmethod
    def family(config: HFConfig) -> DecoderFamily:
        raise NotImplementedError

    def make_mlp(self, config: HFConfig, family: DecoderFamily, layer_idx: int) -> nn.Module:
        return GatedMLP(config.hidden_size, config.intermediate_size, bias=family.mlp_bias,
                        activation=family.activation)

    def checkpoint_target(self, name: str) -> tuple[str | None, tuple]:
        """Our parameter for a checkpoint tensor, and the extra arguments its weight_loader takes; None for a
        tensor the model does not serve (a vision tower beside the text model)."""
        kv_scale = kv_scale_target(name)  # before the packed names: k_proj.output_scale is attention's, not k_proj's
        if kv_scale is not None:
            return self._on_this_stage(kv_scale), ()
        for checkpoint_name, (packed_name, shard_id) in self.packed_modules_mapping.items():
            if f".{checkpoint_name}." in name:
                return self._on_this_stage(name.replace(f".{checkpoint_name}.", f".{packed_name}.")), (shard_id,)
        return self._on_this_stage(name), ()

    def _on_this_stage(self, target: str) -> str | None:
        """target if this rank's pipeline stage holds it, else None (the last stage reads a tied LM head from
        the embedding's tensor)."""
        stage = self.stage
        if stage.size == 1:
            return target
        if target.startswith("model.layers."):
            return target if stage.holds(int(target.split(".", 3)[2])) else None
        if target.startswith("model.embed_tokens."):
            if stage.is_first:
                return target
            return target.replace("model.embed_tokens.", "lm_head.") if stage.is_last and self.tie_word_embeddings \
                else None
        if target.startswith(("lm_head.", "model.norm.")):
            return target if stage.is_last else None
        return target

    def forward(self, input_ids, positions, meta: AttentionMetadata, from_previous_stage: torch.Tensor | None = None,
                replaced_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, meta, from_previous_stage, replaced_embeddings)

    def classify_from_tokens(self, token_ids: list[int]) -> None:
        """The classifier as vLLM reads classifier_from_token: two tokens make one label, the second token's LM-head
        row less the first's (its sigmoid is the softmax of the pair: Qwen3-Reranker's P(yes)); otherwise one
        label per token, its row. Every rank calls it after loading, before prepack (it gathers the rows)."""
        rows = self.lm_head.gathered_rows(token_ids)
        self.token_classifier = (rows[1:] - rows[:1]) if len(token_ids) == 2 else rows

    def classify(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """float32 [rows, num_labels]: the classifier head's logits for these last hidden states."""
        if self.score is not None:
            return self.score(hidden_states).float()
        return hidden_states.float() @ self.token_classifier.T

    def compute_logits(self, hidden_states: torch.Tensor, gather: bool = True,
                       num_rows: int | None = None) -> torch.Tensor | None:
        """The LM head's logits (see ParallelLMHead), soft-capped where the family caps them: elementwise, so
        every rank's slice and every sampler path sees capped logits."""
        logits = self.lm_head(hidden_states, gather, num_rows)
        if self.final_logit_softcap is None or logits is None:
            return logits
        cap = self.final_logit_softcap
        return torch.tanh(logits / cap) * cap


class ImageTextCheckpoint:
    """An image-text checkpoint's tensor names, for a model class deriving from this and then DecoderForCausalLM:
    the vision side's (self.visual, None on a rank that holds no tower) under vision_prefixes, the text model's
    under text_prefixes, each checkpoint prefix -> ours, first match wins; any other name is not loaded."""
    vision_prefixes: dict[str, str] = {}
    text_prefixes: dict[str, str] = {}

    def checkpoint_target(self, name: str) -> tuple[str | None, tuple]:
        for prefix, ours in self.vision_prefixes.items():
            if name.startswith(prefix):
                if self.visual is None:
                    return None, ()
                target, args = self.visual.checkpoint_target(ours + name.removeprefix(prefix))
                return (None if target is None else "visual." + target), args
        for prefix, ours in self.text_prefixes.items():
            if name.startswith(prefix):
                return super().checkpoint_target(ours + name.removeprefix(prefix))
        return None, ()
