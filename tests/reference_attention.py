"""The one reference attention that the attention-backend and kernel tests check against: causal softmax in float64."""
import torch


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [seqlen_q, num_heads, head_dim] are the last seqlen_q of the seqlen_k positions of k and v
    [seqlen_k, num_kv_heads, head_dim]; each attends to every position up to its own (KV heads shared by groups)."""
    seqlen_q, seqlen_k = q.size(0), k.size(0)
    group = q.size(1) // k.size(1)
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    query_pos = seqlen_k - seqlen_q + torch.arange(seqlen_q, device=q.device)
    scores.masked_fill_(torch.arange(seqlen_k, device=q.device)[None, :] > query_pos[:, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    seqlen_k: int, scale: float) -> torch.Tensor:
    """causal_attention over the first seqlen_k positions of a sequence, read from the caches
    [num_blocks, block_size, num_kv_heads, head_dim] through its block table."""
    block_size = k_cache.size(1)
    pos = torch.arange(seqlen_k, device=k_cache.device)
    blocks = block_table[pos // block_size].long()
    return causal_attention(q, k_cache[blocks, pos % block_size], v_cache[blocks, pos % block_size], scale)
