"""The one reference attention that the attention-backend and kernel tests check against: causal softmax in float64."""
import torch


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, window: int | None = None,
                     softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [seqlen_q, num_heads, head_dim] are the last seqlen_q of the seqlen_k positions of k and v
    [seqlen_k, num_kv_heads, head_dim]; each attends to every position up to its own (KV heads shared by groups),
    only the last `window` of them when given; softcap and sinks as transformers' Gemma 2 and gpt-oss apply them."""
    seqlen_q, seqlen_k = q.size(0), k.size(0)
    group = q.size(1) // k.size(1)
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    query_pos = seqlen_k - seqlen_q + torch.arange(seqlen_q, device=q.device)
    key_pos = torch.arange(seqlen_k, device=q.device)[None, :]
    hidden = key_pos > query_pos[:, None]
    if window is not None:
        hidden |= key_pos <= query_pos[:, None] - window
    scores.masked_fill_(hidden, float("-inf"))
    if sinks is not None:
        sink_column = sinks.double().view(-1, 1, 1).expand(-1, seqlen_q, 1)
        probs = torch.cat([scores, sink_column], dim=-1).softmax(dim=-1)[..., :-1]
    else:
        probs = scores.softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    seqlen_k: int, scale: float, **features) -> torch.Tensor:
    """causal_attention over the first seqlen_k positions of a sequence, read from the caches
    [num_blocks, block_size, num_kv_heads, head_dim] through its block table."""
    block_size = k_cache.size(1)
    pos = torch.arange(seqlen_k, device=k_cache.device)
    blocks = block_table[pos // block_size].long()
    return causal_attention(q, k_cache[blocks, pos % block_size], v_cache[blocks, pos % block_size], scale,
                            **features)
