"""Paged attention in plain PyTorch: runs anywhere, and is the reference for the other backends."""
import torch
import torch.nn.functional as F

from tpengine.attention.backend import AttentionBackend
from tpengine.attention.metadata import AttentionMetadata


def gather_paged(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first num_tokens cached rows of one sequence: [num_tokens, num_kv_heads, head_dim]."""
    block_size = cache.size(1)
    num_blocks = (num_tokens + block_size - 1) // block_size
    return cache[block_table[:num_blocks]].flatten(0, 1)[:num_tokens]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def store_kvcache(self, k, v, k_cache, v_cache, slot_mapping):
        valid = slot_mapping >= 0
        slots = slot_mapping[valid]
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[valid])
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[valid])

    def prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale):
        out = torch.empty_like(q)
        start = 0
        for b, (len_q, len_k) in enumerate(zip(meta.seqlens_q, meta.seqlens_k)):
            end = start + len_q
            if len_k == len_q:  # nothing cached before: attend to the fresh K/V directly
                k_b, v_b, mask, causal = k[start:end], v[start:end], None, True
            else:
                block_table = meta.block_tables[b]
                k_b = gather_paged(k_cache, block_table, len_k)
                v_b = gather_paged(v_cache, block_table, len_k)
                # query i sits at position len_k - len_q + i: causal from the bottom-right corner
                mask = torch.ones(len_q, len_k, dtype=torch.bool, device=q.device).tril(len_k - len_q)
                causal = False
            out[start:end] = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1), k_b.transpose(0, 1), v_b.transpose(0, 1),
                attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True).transpose(0, 1)
            start = end
        return out

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale):
        batch = q.size(0)
        block_tables = meta.block_tables
        # [batch, max_blocks, block_size, kv_heads, dim] -> [batch, kv_heads, max_len, dim]
        k = k_cache[block_tables].flatten(1, 2).transpose(1, 2)
        v = v_cache[block_tables].flatten(1, 2).transpose(1, 2)
        positions = torch.arange(k.size(2), device=q.device)
        mask = (positions[None, :] < meta.context_lens[:, None]).view(batch, 1, 1, -1)
        out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        return out.squeeze(2)
