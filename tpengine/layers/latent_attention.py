"""Multi-head latent attention (DeepSeek V2/V3, Kimi K2), over a paged cache of one latent per token.

Each token's keys and values are compressed into one latent c (kv_lora_rank values, RMS-normed) and one rotary key
k_pe (qk_rope_head_dim values) shared by every head; head h's key is [W_uk[h] c, k_pe] and its value W_uv[h] c, with
W_uk and W_uv the rows of kv_b_proj. The cache holds [c, k_pe] per token: one 576-wide vector at DeepSeek's sizes,
no heads, so it is whole on every rank (each rank computes it; its heads' projections are its shard).

Two ways to attend, the same scores:
- absorbed: W_uk folds into each query (q_nope W_uk[h], then q_pe), so attention is MQA over the cached vectors
  themselves, the values being the same vectors (their first kv_lora_rank columns); W_uv then maps each head's
  output. Any attention backend runs it: it reads no per-head K/V (decode through the backend's decode_latent: the
  Triton backend's kernel reads each vector once for both products and splits long contexts).
- expanded: each chunk's keys and values are made per head from the cached latents (kv_b_proj over every key), then
  ordinary attention with qk_nope + qk_rope wide keys and v_head_dim wide values. Cheaper for a long prefill chunk,
  whose many queries share the expansion.
Decode rows always absorb; prefill rows take the cheaper by FLOPs unless prefill_form says which.
"""
import torch
from torch import nn

from tpengine.attention.backend import AttentionBackend
from tpengine.attention.kv_cache_dtype import dequantize_kv
from tpengine.attention.metadata import AttentionMetadata
from tpengine.attention.torch_backend import attend, gather_paged
from tpengine.distributed.parallel_state import divide, get_tp_group
from tpengine.hf_config import HFConfig, max_positions_of, rope_parameters_of
from tpengine.layers.attention import Attention
from tpengine.layers.layernorm import RMSNorm
from tpengine.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from tpengine.layers.load_state import load_state
from tpengine.layers.rotary_embedding import get_rope, yarn_mscale

LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm and kv_a_layernorm with the class default


def softmax_scale(config: HFConfig) -> float:
    """qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared where the rope sets mscale_all_dim
    (transformers' yarn_apply_mscale: DeepSeek scales the unrotated dimensions' scores too)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope = rope_parameters_of(config)
    if rope.rope_type != "default" and rope.mscale_all_dim:
        mscale = yarn_mscale(rope.factor, rope.mscale_all_dim)
        scale = scale * mscale * mscale
    return scale


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x's rotary dimensions turned by each token's angles (cos, sin: [tokens, 1, dim / 2]). interleaved: the
    pairs are (0, 1), (2, 3), ... as DeepSeek's checkpoints lay them out; otherwise (i, i + dim / 2). Either way the
    result lists the pairs' first members, then their second (transformers' output for both: their dot products
    are what attention reads)."""
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class LatentAttention(nn.Module):
    """One layer's MLA on this rank's heads. Checkpoint names as transformers': q_proj (no q_lora_rank) or
    q_a_proj, q_a_layernorm, q_b_proj; kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj; o_proj."""

    def __init__(self, config: HFConfig, family, backend: AttentionBackend, layer_idx: int):
        super().__init__()
        tp = get_tp_group()
        total_heads = config.num_attention_heads
        self.num_heads = divide(total_heads, tp.size)
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.latent_dim = config.kv_lora_rank
        qk_dim = self.nope_dim + self.rope_dim
        hidden, bias = config.hidden_size, config.attention_bias
        if config.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, total_heads * qk_dim)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, total_heads * qk_dim)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.latent_dim + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.latent_dim, eps=LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(self.latent_dim, total_heads * (self.nope_dim + self.v_dim))
        # float only: its rows are folded into the queries and outputs (W_uk, W_uv) after loading
        load_state(self.kv_b_proj.weight).takes = ()
        self.o_proj = RowParallelLinear(total_heads * self.v_dim, hidden, bias=bias)
        self.rotary_emb = get_rope(self.rope_dim, max_positions_of(config), rope_parameters_of(config, layer_idx))
        # transformers' DeepSeek V2 always rotates interleaved pairs (as complex numbers); V3 as rope_interleave says
        self.interleaved = config.rope_interleave or config.model_type == "deepseek_v2"
        self.attn = Attention(self.num_heads, 1, self.latent_dim + self.rope_dim, softmax_scale(config), backend,
                              values_are_keys=True)
        self.prefill_form = "auto"  # the runner sets EngineConfig.mla_prefill
        self.w_uk = self.w_uv = None  # [heads, nope, latent] and [heads, latent, v]: prepack

    def prepack(self, weight_dtype: torch.dtype | None = None) -> None:
        """W_uk and W_uv from kv_b_proj's rows, before kv_b_proj packs (and frees) its weight: prepack runs on a
        module before its children."""
        weight = self.kv_b_proj.weight
        # in the model's dtype, where the weight was loaded in the platform's weight dtype (keep_weights_in)
        dtype = load_state(weight).run_dtype or weight.dtype
        rows = weight.view(self.num_heads, self.nope_dim + self.v_dim, self.latent_dim).to(dtype)
        self.w_uk = rows[:, :self.nope_dim].clone()
        self.w_uv = rows[:, self.nope_dim:].transpose(1, 2).contiguous()

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden_states.size(0)
        if hasattr(self, "q_proj"):
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(num_tokens, self.num_heads, self.nope_dim + self.rope_dim)
        compressed = self.kv_a_proj_with_mqa(hidden_states)
        cos_sin = self.rotary_emb.cos_sin_cache.index_select(0, positions)[:, None].to(q.dtype)
        cos, sin = cos_sin.chunk(2, dim=-1)
        # the cache entry: [normed latent, rotated shared key], as one KV head
        entry = torch.cat([self.kv_a_layernorm(compressed[:, :self.latent_dim].contiguous()),
                           rotate(compressed[:, None, self.latent_dim:], cos, sin, self.interleaved)[:, 0]],
                          dim=-1).view(num_tokens, 1, -1)
        q_nope, q_pe = q[..., :self.nope_dim], rotate(q[..., self.nope_dim:], cos, sin, self.interleaved)
        out = self._attend(q_nope, q_pe, entry, meta)
        return self.o_proj(out.flatten(1))

    def _attend(self, q_nope, q_pe, entry, meta: AttentionMetadata) -> torch.Tensor:
        """[tokens, heads, v_head_dim]: the entries stored, then decode rows absorbed, prefill rows either way."""
        attn, backend = self.attn, self.attn.backend
        backend.store_kvcache(entry, entry, attn.k_cache, attn.v_cache, meta.slot_mapping, attn.k_scale,
                              attn.k_scale)
        if not meta.is_prefill:
            return self._absorbed(q_nope, q_pe, lambda q: backend.decode_latent(q, attn.k_cache, meta, attn.params,
                                                                                self.latent_dim))
        n = meta.num_decode_tokens
        if self._expands(meta):
            prefill = self._expanded(q_nope[n:], q_pe[n:], entry[n:], meta)
        else:
            prefill = self._absorbed(q_nope[n:], q_pe[n:], lambda q: backend.prefill(
                q, entry[n:], entry[n:], attn.k_cache, attn.v_cache, meta, attn.params))
        if not n:
            return prefill
        decode = self._absorbed(q_nope[:n], q_pe[:n], lambda q: backend.decode_latent(
            q, attn.k_cache, meta.decode, attn.params, self.latent_dim))
        return torch.cat([decode, prefill])

    def _absorbed(self, q_nope, q_pe, attend_latents) -> torch.Tensor:
        """MQA over the cached entries: queries [q_nope W_uk, q_pe], the output's latent part through W_uv."""
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
        out = attend_latents(torch.cat([q_latent, q_pe], dim=-1))[..., :self.latent_dim]  # decode gives just that
        return torch.bmm(out.transpose(0, 1), self.w_uv).transpose(0, 1)

    def _expands(self, meta: AttentionMetadata) -> bool:
        """Whether the prefill rows attend expanded: as prefill_form says, else where it costs fewer FLOPs (the
        expansion of every key against the absorbed form's wider products and its two projections per query)."""
        if self.prefill_form != "auto":
            return self.prefill_form == "expanded"
        latent, nope, rope, v = self.latent_dim, self.nope_dim, self.rope_dim, self.v_dim
        pairs = sum(q * k for q, k in zip(meta.seqlens_q, meta.seqlens_k))
        absorbed = pairs * 2 * (latent + rope) + sum(meta.seqlens_q) * latent * (nope + v)
        expanded = pairs * (nope + rope + v) + sum(meta.seqlens_k) * latent * (nope + v)
        return expanded < absorbed

    def _expanded(self, q_nope, q_pe, entry, meta: AttentionMetadata) -> torch.Tensor:
        """Each sequence's keys and values per head, from its cached latents (the new ones as computed), then
        causal attention over them."""
        attn, latent = self.attn, self.latent_dim
        out = q_nope.new_empty(q_nope.size(0), self.num_heads, self.v_dim)
        start = 0
        for b, (len_q, len_k) in enumerate(zip(meta.seqlens_q, meta.seqlens_k)):
            end = start + len_q
            if len_k == len_q:
                entries = entry[start:end]
            else:
                entries = dequantize_kv(gather_paged(attn.k_cache, meta.block_tables[b], len_k), attn.k_scale,
                                        q_nope.dtype)
            kv = self.kv_b_proj(entries[:, 0, :latent].contiguous()).view(len_k, self.num_heads, -1)
            k_pe = entries[:, :, latent:].expand(len_k, self.num_heads, self.rope_dim)
            keys = torch.cat([kv[..., :self.nope_dim], k_pe], dim=-1)
            queries = torch.cat([q_nope[start:end], q_pe[start:end]], dim=-1)
            out[start:end] = attend(queries, keys, kv[..., self.nope_dim:], 0, attn.params)
            start = end
        return out
