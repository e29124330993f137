"""Paged attention in plain PyTorch: runs anywhere, and is the reference for the other backends."""
import torch
import torch.nn.functional as F

from tpengine.attention.backend import AttentionBackend
from tpengine.attention.metadata import AttentionMetadata
from tpengine.paging import blocks_for
from tpengine.platforms.torch_ops import store_kvcache_masked


def gather_paged(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first num_tokens cached rows of one sequence: [num_tokens, num_kv_heads, head_dim]."""
    block_size = cache.size(1)
    num_blocks = blocks_for(num_tokens, block_size)
    return cache[block_table[:num_blocks]].flatten(0, 1)[:num_tokens]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def store_kvcache(self, k, v, k_cache, v_cache, slot_mapping):
        store_kvcache_masked(k, v, k_cache, v_cache, slot_mapping)

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
            # [1, heads, tokens, head_dim]: with a batch dimension the CPU takes SDPA's flash kernel,
            # 3x faster than the math path 3-D inputs get
            out[start:end] = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1)[None], k_b.transpose(0, 1)[None], v_b.transpose(0, 1)[None],
                attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)[0].transpose(0, 1)
            start = end
        return out

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale):
        # On the host, one sequence at a time over views of its own blocks: gathering padded block
        # tables into one batch tensor copied every block in full each layer, several times the work.
        block_size = k_cache.size(1)
        num_kv_heads = k_cache.size(2)
        out = torch.empty_like(q)
        context_lens = meta.seqlens_k if meta.seqlens_k is not None else meta.context_lens.tolist()
        block_tables = meta.block_tables_list if meta.block_tables_list is not None else meta.block_tables.tolist()
        for b, (context_len, block_table) in enumerate(zip(context_lens, block_tables)):
            if context_len == 0:  # a padding row: nothing to attend to
                out[b] = 0
                continue
            q_b = q[b].view(num_kv_heads, -1, q.size(-1))  # query heads grouped by the KV head they share
            ends = range(block_size, context_len + block_size, block_size)
            keys = [k_cache[block, :min(block_size, context_len - end + block_size)]
                    for block, end in zip(block_table, ends)]
            # scores over the whole context, one softmax; [kv_heads, group, context_len]
            probs = torch.cat([q_b @ k.permute(1, 2, 0) for k in keys], dim=-1).mul_(scale).softmax(dim=-1)
            start = 0
            out_b = None
            for block, k in zip(block_table, keys):
                n = k.size(0)
                part = probs[..., start:start + n] @ v_cache[block, :n].transpose(0, 1)
                out_b = part if out_b is None else out_b.add_(part)
                start += n
            out[b] = out_b.view(-1, q.size(-1))
        return out
