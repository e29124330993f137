"""Paged attention in plain PyTorch: runs anywhere, and is the reference for the other backends.

An FP8 cache is quantized in the store and dequantized wherever a cache row is read (kv_cache_dtype.py), the
Triton kernels' math; the CPU keeps twice the tokens in the same memory this way."""
import itertools

import torch
import torch.nn.functional as F

from tpengine.attention.backend import AttentionBackend, AttentionParams
from tpengine.attention.kv_cache_dtype import dequantize_kv, is_fp8, quantize_kv
from tpengine.attention.metadata import AttentionMetadata
from tpengine.paging import blocks_for
from tpengine.platforms.torch_ops import store_kvcache_masked


def gather_paged(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int, first_block: int = 0) -> torch.Tensor:
    """Cached rows first_block * block_size .. num_tokens - 1 of one sequence: [rows, num_kv_heads, head_dim]."""
    block_size = cache.size(1)
    num_blocks = blocks_for(num_tokens, block_size)
    return cache[block_table[first_block:num_blocks]].flatten(0, 1)[:num_tokens - first_block * block_size]


def first_block_in_window(query_pos: int, params: AttentionParams, block_size: int) -> int:
    """The first block that holds a key query_pos can see: blocks before it are never read."""
    if params.sliding_window is None:
        return 0
    return max(0, query_pos - params.sliding_window + 1) // block_size


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_start: int, params: AttentionParams,
           key_ends: torch.Tensor | None = None) -> torch.Tensor:
    """q [len_q, heads, head_dim] at the last len_q positions of key_start + len(k); k, v [len_k, kv_heads, head_dim]
    hold positions key_start.. . Causal, within the window, with the layer's soft cap and sinks; key_ends [len_q]:
    each query sees positions below its key end instead (at least its own position + 1)."""
    len_q, len_k = q.size(0), k.size(0)
    first_query = key_start + len_k - len_q
    window = params.sliding_window
    plain = params.logit_softcap is None and params.sinks is None
    if plain and key_ends is None and key_start == 0 and len_q == len_k and (window is None or window >= len_k):
        mask, causal = None, True  # nothing cached before and no window inside: SDPA's own causal mask
    else:
        query_pos = torch.arange(first_query, first_query + len_q, device=q.device)[:, None]
        key_pos = torch.arange(key_start, key_start + len_k, device=q.device)[None, :]
        mask = key_pos <= query_pos if key_ends is None else key_pos < key_ends.to(key_pos.dtype)[:, None]
        if window is not None:  # the window stays behind the query's own position (transformers' AND)
            mask &= key_pos > query_pos - window
        causal = False
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [heads, tokens, head_dim]
    if plain:
        # [1, heads, tokens, head_dim]: with a batch dimension the CPU takes SDPA's flash kernel,
        # 3x faster than the math path 3-D inputs get
        return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, is_causal=causal,
                                              scale=params.scale, enable_gqa=True)[0].transpose(0, 1)
    group = q.size(0) // k.size(0)
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    scores = (q @ k.transpose(1, 2)).float() * params.scale
    if params.logit_softcap is not None:
        scores = torch.tanh(scores / params.logit_softcap) * params.logit_softcap
    scores.masked_fill_(~mask, float("-inf"))
    if params.sinks is not None:  # one more term in each row's softmax, dropped before the values
        sinks = params.sinks.float().view(-1, 1, 1).expand(-1, len_q, 1)
        probs = torch.cat([scores, sinks], dim=-1).softmax(dim=-1)[..., :-1]
    else:
        probs = scores.softmax(dim=-1)
    return (probs.to(v.dtype) @ v).transpose(0, 1)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def store_kvcache(self, k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
        if is_fp8(k_cache.dtype):  # stored as bytes: index_copy_ has no float8 kernel
            k, v = quantize_kv(k, k_scale).view(torch.uint8), quantize_kv(v, v_scale).view(torch.uint8)
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        store_kvcache_masked(k, v, k_cache, v_cache, slot_mapping)

    def prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, params: AttentionParams):
        out = torch.empty_like(q)
        self.prefill_chunks(q, k, v, k_cache, v_cache, meta, params, out, range(len(meta.seqlens_q)))
        return out

    def prefill_chunks(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, params: AttentionParams,
                       out: torch.Tensor, chunks) -> None:
        """The rows of out of the given chunks (indices into meta.seqlens_q), one chunk at a time."""
        block_size = k_cache.size(1)
        starts = itertools.accumulate(meta.seqlens_q, initial=0)
        chunks = set(chunks)
        for b, (start, len_q, len_k) in enumerate(zip(starts, meta.seqlens_q, meta.seqlens_k)):
            if b not in chunks:
                continue
            end = start + len_q
            first = first_block_in_window(len_k - len_q, params, block_size)
            # nothing cached before: attend to the fresh K/V directly (an FP8 cache's are read back quantized)
            if len_k == len_q and not is_fp8(k_cache.dtype):
                k_b, v_b, key_start = k[start:end], v[start:end], 0
            else:
                block_table = meta.block_tables[b]
                k_b = dequantize_kv(gather_paged(k_cache, block_table, len_k, first), params.k_scale, q.dtype)
                v_b = dequantize_kv(gather_paged(v_cache, block_table, len_k, first), params.v_scale, q.dtype)
                key_start = first * block_size
            key_ends = None if meta.key_ends is None else meta.key_ends[start:end]
            self.attend_chunk(q[start:end], k_b, v_b, key_start, params, key_ends, out[start:end])

    def attend_chunk(self, q, k, v, key_start: int, params: AttentionParams, key_ends, out: torch.Tensor) -> None:
        """One prompt chunk's attention over its keys (attend's contract) into out: a backend's own kernel where it
        has one."""
        out.copy_(attend(q, k, v, key_start, params, key_ends))

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, params: AttentionParams):
        # On the host, one sequence at a time over views of its own blocks: gathering padded block
        # tables into one batch tensor copied every block in full each layer, several times the work.
        if params.logit_softcap is not None or params.sinks is not None:
            return self._decode_general(q, k_cache, v_cache, meta, params)
        block_size = k_cache.size(1)
        num_kv_heads = k_cache.size(2)
        scale, window = params.scale, params.sliding_window
        out = torch.empty_like(q)
        context_lens = meta.seqlens_k if meta.seqlens_k is not None else meta.context_lens.tolist()
        block_tables = meta.block_tables_list if meta.block_tables_list is not None else meta.block_tables.tolist()
        for b, (context_len, block_table) in enumerate(zip(context_lens, block_tables)):
            if context_len == 0:  # a padding row: nothing to attend to
                out[b] = 0
                continue
            q_b = q[b].view(num_kv_heads, -1, q.size(-1))  # query heads grouped by the KV head they share
            # the keys this query sees, as (block, first row, end row) pieces
            first_key = 0 if window is None else max(0, context_len - window)
            pieces = [(block_table[i], max(first_key - i * block_size, 0), min(block_size, context_len - i * block_size))
                      for i in range(first_key // block_size, blocks_for(context_len, block_size))]
            keys = [dequantize_kv(k_cache[block, lo:hi], params.k_scale, q.dtype) for block, lo, hi in pieces]
            # scores over the whole context, one softmax; [kv_heads, group, context_len]
            probs = torch.cat([q_b @ k.permute(1, 2, 0) for k in keys], dim=-1).mul_(scale).softmax(dim=-1)
            start = 0
            out_b = None
            for block, lo, hi in pieces:
                n = hi - lo
                values = dequantize_kv(v_cache[block, lo:hi], params.v_scale, q.dtype)
                part = probs[..., start:start + n] @ values.transpose(0, 1)
                out_b = part if out_b is None else out_b.add_(part)
                start += n
            out[b] = out_b.view(-1, q.size(-1))
        return out

    def _decode_general(self, q, k_cache, v_cache, meta: AttentionMetadata, params: AttentionParams):
        """Decode with a soft cap or sinks: each row as a one-token prefill over its cached keys."""
        block_size = k_cache.size(1)
        out = torch.empty_like(q)
        context_lens = meta.seqlens_k if meta.seqlens_k is not None else meta.context_lens.tolist()
        for b, context_len in enumerate(context_lens):
            if context_len == 0:
                out[b] = 0
                continue
            first = first_block_in_window(context_len - 1, params, block_size)
            block_table = meta.block_tables[b]
            k_b = dequantize_kv(gather_paged(k_cache, block_table, context_len, first), params.k_scale, q.dtype)
            v_b = dequantize_kv(gather_paged(v_cache, block_table, context_len, first), params.v_scale, q.dtype)
            out[b] = attend(q[b:b + 1], k_b, v_b, first * block_size, params)[0]
        return out
