import pytest
import torch

from tpengine.kernels.triton import paged_decode_attention


@pytest.mark.parametrize(
    "block_size, head_dim, num_heads, num_kv_heads, context_lens, dtype, tol",
    [
        # context 1, exactly a block, a block + 1, several blocks
        (16, 64, 2, 2, [1, 16, 17, 70], torch.float32, 1e-4),
        (32, 48, 4, 2, [33, 5], torch.float32, 1e-4),
        (256, 96, 4, 1, [256, 257], torch.float32, 1e-4),
        (16, 128, 4, 1, [40, 3], torch.float16, 1e-2),
    ],
)
def test_paged_decode_attention(
    block_size, head_dim, num_heads, num_kv_heads, context_lens, dtype, tol, paged_kv, ref_attention, rel_err
):
    k_cache, v_cache, block_tables = paged_kv(context_lens, block_size, num_kv_heads, head_dim, dtype)
    # q as a strided view, like the query part of a fused QKV projection
    q = torch.randn(len(context_lens), num_heads + 2, head_dim, dtype=dtype)[:, :num_heads]
    scale = head_dim**-0.5
    lens = torch.tensor(context_lens, dtype=torch.int32)

    out = paged_decode_attention(q, k_cache, v_cache, block_tables, lens, scale)

    assert out.dtype == dtype and not out.isnan().any()
    for b, n in enumerate(context_lens):
        ref = ref_attention(q[b : b + 1], k_cache, v_cache, block_tables[b], n, scale)
        assert rel_err(out[b : b + 1], ref) < tol


def test_paged_decode_attention_empty_context(paged_kv):
    # A padded batch slot (context length 0) must produce zeros, not NaN, and not disturb its neighbour.
    k_cache, v_cache, block_tables = paged_kv([20, 0], 16, 1, 64, torch.float32)
    q = torch.randn(2, 1, 64)
    out = paged_decode_attention(q, k_cache, v_cache, block_tables, torch.tensor([20, 0], dtype=torch.int32), 0.125)
    assert not out[0].isnan().any() and torch.equal(out[1], torch.zeros_like(out[1]))
