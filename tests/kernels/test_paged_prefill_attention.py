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
