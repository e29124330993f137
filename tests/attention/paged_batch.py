"""Random paged-attention batches for the backend tests, with a naive float64 reference to check them against."""
from dataclasses import dataclass

import torch

from tests.reference_attention import causal_attention
from tpengine.attention.backend import AttentionParams
from tpengine.attention.metadata import AttentionMetadata

GARBAGE = 50.0  # scale of what unowned cache slots hold: reading one shows up in the output


@dataclass
class PagedBatch:
    q: torch.Tensor                 # [new tokens, heads, head_dim]
    k: torch.Tensor                 # [new tokens, kv_heads, head_dim]: this step's keys, stored by forward
    v: torch.Tensor
    k_cache: torch.Tensor           # [num_blocks, block_size, kv_heads, head_dim]: the cached prefixes, and garbage
    v_cache: torch.Tensor
    meta: AttentionMetadata
    keys: list[torch.Tensor]        # per sequence, every key it attends to (prefix, then new), in order
    values: list[torch.Tensor]
    num_new: list[int]              # per sequence, how many of its keys are this step's
    params: AttentionParams         # the layer's scale, window, soft cap and sinks


def _garbage_caches(num_blocks, block_size, num_kv_heads, head_dim, dtype, device, g):
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [(torch.randn(shape, generator=g, device="cpu") * GARBAGE).to(dtype=dtype, device=device) for _ in range(2)]


def paged_batch(seqs: list[tuple[int, int]], *, decode: bool = False, block_size: int = 16, num_heads: int = 4,
                num_kv_heads: int = 2, head_dim: int = 32, dtype=torch.float32, device="cpu",
                seed: int = 0, window: int | None = None, softcap: float | None = None,
                sinks: bool = False) -> PagedBatch:
    """seqs[b] = (tokens already cached, new tokens); decode batches have exactly one new token each.
    window, softcap and sinks (random ones) make a layer with those features (AttentionParams).

    Each sequence owns scattered physical blocks; its block table is padded with 0, as the runner pads it.
    """
    assert not decode or all(new == 1 for _, new in seqs)
    g = torch.Generator(device="cpu").manual_seed(seed)
    blocks_per_seq = [-(-(cached + new) // block_size) for cached, new in seqs]
    num_blocks = sum(blocks_per_seq) + 3
    physical = torch.randperm(num_blocks, generator=g, device="cpu").tolist()
    tables = [[physical.pop() for _ in range(n)] for n in blocks_per_seq]
    k_cache, v_cache = _garbage_caches(num_blocks, block_size, num_kv_heads, head_dim, dtype, device, g)

    def rand(*shape):
        return torch.randn(shape, generator=g, device="cpu").to(dtype=dtype, device=device)

    keys, values, new_k, new_v, slot_mapping = [], [], [], [], []
    for (cached, new), table in zip(seqs, tables):
        k_all, v_all = rand(cached + new, num_kv_heads, head_dim), rand(cached + new, num_kv_heads, head_dim)
        for pos in range(cached + new):
            slot = table[pos // block_size] * block_size + pos % block_size
            if pos < cached:
                k_cache.view(-1, num_kv_heads, head_dim)[slot] = k_all[pos]
                v_cache.view(-1, num_kv_heads, head_dim)[slot] = v_all[pos]
            else:
                slot_mapping.append(slot)
        keys.append(k_all)
        values.append(v_all)
        new_k.append(k_all[cached:])
        new_v.append(v_all[cached:])
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    seqlens_q = [new for _, new in seqs]
    seqlens_k = [cached + new for cached, new in seqs]
    common = dict(slot_mapping=torch.tensor(slot_mapping, device=device), block_tables=block_tables,
                  block_tables_list=tables, seqlens_k=seqlens_k)
    if decode:
        meta = AttentionMetadata(is_prefill=False, context_lens=torch.tensor(seqlens_k, dtype=torch.int32,
                                 device=device), max_seqlen_k=max(seqlens_k), **common)
    else:
        def cumulative(lengths):
            return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
        meta = AttentionMetadata(
            is_prefill=True, cu_seqlens_q=cumulative(seqlens_q), cu_seqlens_k=cumulative(seqlens_k),
            seqlens_q=seqlens_q, max_seqlen_q=max(seqlens_q), max_seqlen_k=max(seqlens_k),
            has_cached_prefix=any(cached for cached, _ in seqs), **common)
    sink_logits = (torch.randn(num_heads, generator=g, device="cpu") * 2).to(device) if sinks else None
    params = AttentionParams(head_dim ** -0.5, window, softcap, sink_logits)
    return PagedBatch(q=rand(sum(seqlens_q), num_heads, head_dim), k=torch.cat(new_k), v=torch.cat(new_v),
                      k_cache=k_cache, v_cache=v_cache, meta=meta, keys=keys, values=values,
                      num_new=seqlens_q, params=params)


def mixed_batch(seqs: list[tuple[int, int]], num_decode: int, **kwargs) -> PagedBatch:
    """A mixed step as the runner builds it: the first num_decode sequences (one new token each) are decode
    rows with their own decode metadata, the rest prefill chunks; one slot mapping covers every row."""
    assert all(new == 1 for _, new in seqs[:num_decode]) and num_decode < len(seqs)
    batch = paged_batch(seqs, **kwargs)
    full = batch.meta
    device = full.slot_mapping.device
    tables, lens_k = full.block_tables_list, full.seqlens_k

    def block_tables(rows):
        width = max(len(t) for t in rows)
        return torch.tensor([t + [0] * (width - len(t)) for t in rows], dtype=torch.int32, device=device)

    def cumulative(lengths):
        return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    decode = AttentionMetadata(
        is_prefill=False, slot_mapping=full.slot_mapping[:num_decode], block_tables=block_tables(tables[:num_decode]),
        block_tables_list=tables[:num_decode], seqlens_k=lens_k[:num_decode],
        context_lens=torch.tensor(lens_k[:num_decode], dtype=torch.int32, device=device),
        max_seqlen_k=max(lens_k[:num_decode]))
    seqlens_q = batch.num_new[num_decode:]
    batch.meta = AttentionMetadata(
        is_prefill=True, slot_mapping=full.slot_mapping, block_tables=block_tables(tables[num_decode:]),
        block_tables_list=tables[num_decode:], seqlens_k=lens_k[num_decode:], cu_seqlens_q=cumulative(seqlens_q),
        cu_seqlens_k=cumulative(lens_k[num_decode:]), seqlens_q=seqlens_q, max_seqlen_q=max(seqlens_q),
        max_seqlen_k=max(lens_k[num_decode:]), has_cached_prefix=any(c for c, _ in seqs[num_decode:]),
        num_decode_tokens=num_decode, decode=decode)
    return batch


def reference_attention(batch: PagedBatch) -> torch.Tensor:
    """Each new token attends, in float64, to every key of its sequence up to and including its own position."""
    rows = batch.q.split(batch.num_new)
    p = batch.params
    return torch.cat([causal_attention(q, k, v, p.scale, window=p.sliding_window, softcap=p.logit_softcap,
                                       sinks=p.sinks) for q, k, v in zip(rows, batch.keys, batch.values)])


def forward_each(batch: PagedBatch, *backends) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each backend's output and caches, from its own copy of the same inputs (forward stores, then attends)."""
    results = []
    for backend in backends:
        k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
        out = backend.forward(batch.q, batch.k, batch.v, k_cache, v_cache, batch.meta, batch.params)
        results.append((out, k_cache, v_cache))
    return results
