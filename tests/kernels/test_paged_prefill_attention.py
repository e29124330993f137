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
