"""The decoder every supported family shares, built from tensor-parallel layers; it never mentions ranks.

    embed -> N x [RMSNorm -> attention (q/k/v, rotary, o; the layer's sliding window) -> + residual
                  RMSNorm -> gated SiLU MLP (or experts)   -> + residual] -> RMSNorm -> LM head

The families differ in a few properties (DecoderFamily); each model file states its own and
documents its architecture.
"""
from dataclasses import dataclass

import torch
from torch import nn

from tpengine.attention.backend import AttentionBackend
from tpengine.attention.metadata import AttentionMetadata
from tpengine.hf_config import HFConfig, head_dim_of, layer_sliding_window, max_positions_of, rope_parameters_of
from tpengine.layers.activation import SiluAndMul
from tpengine.layers.attention import Attention
from tpengine.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from tpengine.layers.layernorm import RMSNorm
from tpengine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tpengine.layers.rotary_embedding import get_rope


@dataclass(frozen=True)
class DecoderFamily:
    qkv_bias: bool = False   # bias on the q, k and v projections
    o_bias: bool = False     # bias on the attention output projection
    mlp_bias: bool = False   # bias on gate, up and down projections
    qk_norm: bool = False    # RMSNorm over each head's queries and keys, before the rotary embedding
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
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size, bias=family.o_bias)
        if family.qk_norm:
            self.q_norm = RMSNorm(head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, eps=config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.rotary_emb = get_rope(head_dim, max_positions_of(config), rope_parameters_of(config))
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, head_dim ** -0.5, backend,
                              sliding_window=layer_sliding_window(config, layer_idx), has_sinks=family.sinks)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, meta: AttentionMetadata):
        qkv = self.qkv_proj(hidden_states)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k, self.q_norm, self.k_norm)  # q/k norm first, where the family has it
        out = self.attn(q, k, v, meta)
        return self.o_proj(out.flatten(1, -1))


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up in one column-parallel matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: HFConfig, family: DecoderFamily, backend: AttentionBackend, mlp: nn.Module,
                 layer_idx: int):
        super().__init__()
        self.self_attn = DecoderAttention(config, family, backend, layer_idx)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

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
    def __init__(self, config: HFConfig, family: DecoderFamily, backend: AttentionBackend, make_mlp):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(config, family, backend, make_mlp(config, family, i), i)
                                     for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, meta)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class DecoderForCausalLM(nn.Module):
    """The causal LM every family file subclasses: it says its family and, if it must, its MLP."""

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
        self.model = DecoderModel(config, self.family(config), backend, self.make_mlp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:  # one tensor: the checkpoint's embedding serves both
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def family(config: HFConfig) -> DecoderFamily:
        raise NotImplementedError

    def make_mlp(self, config: HFConfig, family: DecoderFamily, layer_idx: int) -> nn.Module:
        return GatedMLP(config.hidden_size, config.intermediate_size, bias=family.mlp_bias)

    def checkpoint_target(self, name: str) -> tuple[str, tuple]:
        """Our parameter for a checkpoint tensor, and the extra arguments its weight_loader takes."""
        for checkpoint_name, (packed_name, shard_id) in self.packed_modules_mapping.items():
            if f".{checkpoint_name}." in name:
                return name.replace(f".{checkpoint_name}.", f".{packed_name}."), (shard_id,)
        return name, ()

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden_states: torch.Tensor, gather: bool = True,
                       num_rows: int | None = None) -> torch.Tensor | None:
        return self.lm_head(hidden_states, gather, num_rows)
