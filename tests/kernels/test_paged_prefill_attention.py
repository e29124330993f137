import pytest
import torch

from tpengine.kernels.triton.paged_prefill_attention import paged_prefill_attention

pytestmark = pytest.mark.usefixtures("triton_device")


@pytest.mark.parametrize(
    "block_size, head_dim, num_heads, num_kv_heads, seqlens_q, seqlens_k, dtype, tol",
    [
        # no cached prefix; 70 queries span two query tiles
        (16, 64, 2, 2, [5, 70, 16], [5, 70, 16], torch.float32, 1e-4),
        # cached prefix (prefix hit / chunked prefill), including a 1-token query;
        # 40 queries after a 32-token prefix need keys from two key tiles
        (32, 48, 4, 2, [1, 40, 3], [33, 72, 3], torch.float32, 1e-4),
        (256, 96, 4, 1, [7, 1], [300, 1], torch.float32, 1e-4),
        (16, 128, 4, 1, [9], [40], torch.bfloat16, 2e-2),
    ],
)
def test_paged_prefill_attention(
    block_size, head_dim, num_heads, num_kv_heads, seqlens_q, seqlens_k, dtype, tol, paged_kv, ref_attention, rel_err
):
    k_cache, v_cache, block_tables = paged_kv(seqlens_k, block_size, num_kv_heads, head_dim, dtype)
    cu_seqlens_q = torch.tensor([0] + seqlens_q, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_seqlens_k = torch.tensor([0] + seqlens_k, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    # q as a strided view, like the query part of a fused QKV projection
    q = torch.randn(sum(seqlens_q), num_heads + 2, head_dim, dtype=dtype)[:, :num_heads]
    scale = head_dim**-0.5

    out = paged_prefill_attention(
        q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, block_tables, scale, max(seqlens_q)
    )

    assert out.dtype == dtype and not out.isnan().any()
    for b, n in enumerate(seqlens_k):
        rows = slice(cu_seqlens_q[b], cu_seqlens_q[b + 1])
        ref = ref_attention(q[rows], k_cache, v_cache, block_tables[b], n, scale)
        assert rel_err(out[rows], ref) < tol


@pytest.mark.parametrize("features", [dict(window=20), dict(window=1), dict(softcap=3.0), dict(sinks=True),
                                      dict(window=50, softcap=2.0, sinks=True)], ids=str)
def test_window_softcap_and_sinks_match_reference(features, paged_kv, ref_attention, rel_err):
    """Chunks after a cached prefix and fresh prompts, longer than the window and spanning query and key
    tiles; the blocks before every query's window are NaN and -1 in the table, as the ledger may free them."""
    block_size, head_dim, num_heads, num_kv_heads = 16, 64, 4, 2
    seqlens_q, seqlens_k = [70, 1, 9, 100], [70, 100, 140, 180]
    k_cache, v_cache, block_tables = paged_kv(seqlens_k, block_size, num_kv_heads, head_dim, torch.float32)
    window = features.get("window")
    if window is not None:
        for b, (len_q, len_k) in enumerate(zip(seqlens_q, seqlens_k)):
            for i in range(max(0, len_k - len_q - window + 1) // block_size):
                k_cache[block_tables[b, i]] = v_cache[block_tables[b, i]] = float("nan")
                block_tables[b, i] = -1
    cu_seqlens_q = torch.tensor([0] + seqlens_q, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_seqlens_k = torch.tensor([0] + seqlens_k, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.randn(sum(seqlens_q), num_heads, head_dim)
    sinks = torch.randn(num_heads) * 2 if features.get("sinks") else None
    softcap = features.get("softcap")
    out = paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, block_tables, head_dim**-0.5,
                                  max(seqlens_q), window=window or 0, softcap=softcap or 0.0, sinks=sinks)
    assert not out.isnan().any()
    for b, n in enumerate(seqlens_k):
        rows = slice(cu_seqlens_q[b], cu_seqlens_q[b + 1])
        ref = ref_attention(q[rows], k_cache.nan_to_num(), v_cache.nan_to_num(), block_tables[b].clamp(min=0), n,
                            head_dim**-0.5, window=window, softcap=softcap, sinks=sinks)
        assert rel_err(out[rows], ref) < 1e-4


def image_key_ends(seqlens_q, seqlens_k, image_runs):
    """int32 [total_q]: a query at position p inside an image run [start, end) of its sequence sees keys up to
    the run's end (Gemma 3's bidirectional attention within an image), any other only up to itself."""
    key_ends = []
    for len_q, len_k, runs in zip(seqlens_q, seqlens_k, image_runs):
        for p in range(len_k - len_q, len_k):
            key_ends.append(next((end for start, end in runs if start <= p < end), p + 1))
    return torch.tensor(key_ends, dtype=torch.int32)


def reference_with_key_ends(q, k_cache, v_cache, block_table, seqlen_k, scale, key_ends, *, window=0, softcap=0.0,
                            sinks=None):
    """Dense float64 softmax of one sequence's queries over its gathered keys: query p sees key j iff
    j < key_ends[row] and, with a window, j > p - window."""
    block_size, group = k_cache.size(1), q.size(1) // k_cache.size(2)
    pos = torch.arange(seqlen_k)
    blocks = block_table[pos // block_size].long()
    k = k_cache[blocks, pos % block_size].double().repeat_interleave(group, dim=1)
    v = v_cache[blocks, pos % block_size].double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    query_pos = (seqlen_k - q.size(0) + torch.arange(q.size(0)))[:, None]
    visible = pos[None, :] < key_ends.long()[:, None]
    if window:
        visible &= pos[None, :] > query_pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:  # the sink joins the softmax as one more logit with no value
        scores = torch.cat([scores, sinks.double().view(-1, 1, 1).expand(-1, q.size(0), 1)], dim=-1)
        return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1)[..., :-1], v)
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)


# (block_size, seqlens_q, seqlens_k, image runs [start, end) of key positions per sequence): an 80-row image across
# both of a fresh prompt's query tiles (BLOCK_M 64), images after a cached prefix (one ending at the last key, one
# begun in the prefix), a short prompt
IMAGE_LAYOUTS = {
    "block 16": (16, [90, 20, 5], [90, 50, 5], [[(5, 85)], [(28, 36), (44, 50)], [(1, 4)]]),
    "block 128": (128, [90, 20], [90, 150], [[(3, 83), (85, 89)], [(125, 140), (144, 150)]]),
}


@pytest.mark.parametrize("layout", IMAGE_LAYOUTS)
@pytest.mark.parametrize("features", [dict(), dict(window=20), dict(window=6, softcap=3.0), dict(sinks=True),
                                      dict(window=30, softcap=2.0, sinks=True)], ids=str)
def test_key_ends_let_image_rows_see_their_whole_image(layout, features, paged_kv, rel_err):
    """GQA; with a window, the blocks before every query's window are NaN and -1 in the table, as the ledger may
    free them."""
    block_size, seqlens_q, seqlens_k, image_runs = IMAGE_LAYOUTS[layout]
    head_dim, num_heads, num_kv_heads, window = 32, 4, 2, features.get("window", 0)
    k_cache, v_cache, block_tables = paged_kv(seqlens_k, block_size, num_kv_heads, head_dim, torch.float32)
    for b, (len_q, len_k) in enumerate(zip(seqlens_q, seqlens_k)):
        for i in range(max(0, len_k - len_q - window + 1) // block_size if window else 0):
            k_cache[block_tables[b, i]] = v_cache[block_tables[b, i]] = float("nan")
            block_tables[b, i] = -1
    cu_seqlens_q = torch.tensor([0] + seqlens_q, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_seqlens_k = torch.tensor([0] + seqlens_k, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.randn(sum(seqlens_q), num_heads, head_dim)
    key_ends = image_key_ends(seqlens_q, seqlens_k, image_runs)
    sinks = torch.randn(num_heads) * 2 if features.get("sinks") else None
    softcap = features.get("softcap", 0.0)
    out = paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, block_tables, head_dim**-0.5,
                                  max(seqlens_q), window=window, softcap=softcap, sinks=sinks, key_ends=key_ends)
    assert not out.isnan().any()
    for b, n in enumerate(seqlens_k):
        rows = slice(cu_seqlens_q[b], cu_seqlens_q[b + 1])
        ref = reference_with_key_ends(q[rows], k_cache.nan_to_num(), v_cache.nan_to_num(),
                                      block_tables[b].clamp(min=0), n, head_dim**-0.5, key_ends[rows],
                                      window=window, softcap=softcap, sinks=sinks)
        assert rel_err(out[rows], ref) < 1e-4


def test_key_ends_at_each_query_give_exactly_the_causal_output(paged_kv):
    """Key ends p + 1 walk fewer (only fully hidden) key tiles than the causal loop, and those change nothing."""
    seqlens_q, seqlens_k = [70, 9], [70, 40]
    k_cache, v_cache, block_tables = paged_kv(seqlens_k, 16, 1, 32, torch.float32)
    cu_seqlens_q = torch.tensor([0] + seqlens_q, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_seqlens_k = torch.tensor([0] + seqlens_k, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.randn(sum(seqlens_q), 2, 32)
    args = (q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, block_tables, 32**-0.5, max(seqlens_q))
    key_ends = image_key_ends(seqlens_q, seqlens_k, [[], []])
    for features in (dict(), dict(window=10, softcap=3.0, sinks=torch.randn(2))):
        causal = paged_prefill_attention(*args, **features)
        assert torch.equal(paged_prefill_attention(*args, **features, key_ends=key_ends), causal)
