"""The Triton KV store and paged attention with an FP8 (e4m3) cache: the store gives torch's cast bit for bit, and
attention over the cache matches the float64 reference over its dequantized values."""
import pytest
import torch

from tpengine.attention.kv_cache_dtype import FP8, dequantize_kv, quantize_kv
from tpengine.kernels.triton.paged_decode_attention import paged_decode_attention
from tpengine.kernels.triton.paged_prefill_attention import paged_prefill_attention
from tpengine.kernels.triton.store_kvcache import store_kvcache

pytestmark = pytest.mark.usefixtures("triton_device")

K_SCALE, V_SCALE = 0.37, 1.9  # not 1.0, and not powers of two: the division rounds


def scales():
    return torch.tensor([K_SCALE]), torch.tensor([V_SCALE])


def fp8_paged_kv(paged_kv, seq_lens, block_size, num_kv_heads, head_dim):
    """random_paged_kv's caches (NaN where no token is) quantized to e4m3 with the test's scales."""
    k_cache, v_cache, block_tables = paged_kv(seq_lens, block_size, num_kv_heads, head_dim, torch.float32)
    k_scale, v_scale = scales()
    return quantize_kv(k_cache, k_scale), quantize_kv(v_cache, v_scale), block_tables


def read_back(cache, scale):
    """The cache's values as the kernels read them, in float32 (NaN slots as 0, as the reference reads them)."""
    return dequantize_kv(cache, scale, torch.float32).nan_to_num()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_store_writes_e4m3_of_x_over_scale_bit_exactly(dtype):
    num_tokens, num_kv_heads, head_dim = 40, 2, 48
    # magnitudes from 1e-5 (e4m3's subnormals and zero) to 1e4 (past its 448 after the scale: clamped)
    magnitude = torch.logspace(-5, 4, num_tokens)[:, None, None]
    fused = (torch.randn(num_tokens, num_kv_heads, 3 * head_dim) * magnitude).to(dtype)
    key, value = fused[..., :head_dim], fused[..., 2 * head_dim:]  # strided views, as from a fused QKV
    slots = torch.randperm(4 * 16)[:num_tokens]
    slots[[3, 17]] = -1  # padding tokens
    k_cache = torch.full((4, 16, num_kv_heads, head_dim), float("nan"), dtype=FP8)
    v_cache = k_cache.clone()
    k_scale, v_scale = scales()
    store_kvcache(key, value, k_cache, v_cache, slots, k_scale, v_scale)

    written = slots >= 0
    for cache, x, scale in ((k_cache, key, k_scale), (v_cache, value, v_scale)):
        stored = cache.view(-1, num_kv_heads, head_dim)[slots[written]].view(torch.uint8)
        expected = quantize_kv(x[written], scale).view(torch.uint8)
        assert torch.equal(stored, expected)
        untouched = torch.ones(4 * 16, dtype=torch.bool)
        untouched[slots[written]] = False
        assert cache.view(-1, num_kv_heads, head_dim)[untouched].float().isnan().all()
    assert (quantize_kv(key[written], k_scale).float().abs() == 448).any()  # the clamp was exercised


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)], ids=["float32", "bfloat16"])
def test_decode_matches_reference_over_the_dequantized_cache(dtype, tol, paged_kv, ref_attention, rel_err):
    block_size, head_dim, num_heads, num_kv_heads, context_lens = 16, 64, 4, 2, [1, 16, 17, 70]
    k_cache, v_cache, block_tables = fp8_paged_kv(paged_kv, context_lens, block_size, num_kv_heads, head_dim)
    k_scale, v_scale = scales()
    q = torch.randn(len(context_lens), num_heads + 2, head_dim).to(dtype)[:, :num_heads]
    out = paged_decode_attention(q, k_cache, v_cache, block_tables, torch.tensor(context_lens, dtype=torch.int32),
                                 head_dim**-0.5, k_scale=k_scale, v_scale=v_scale)
    assert out.dtype == dtype and not out.isnan().any()
    keys, values = read_back(k_cache, k_scale), read_back(v_cache, v_scale)
    for b, n in enumerate(context_lens):
        ref = ref_attention(q[b:b + 1], keys, values, block_tables[b].clamp(min=0), n, head_dim**-0.5)
        assert rel_err(out[b:b + 1], ref) < tol


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)], ids=["float32", "bfloat16"])
def test_prefill_matches_reference_over_the_dequantized_cache(dtype, tol, paged_kv, ref_attention, rel_err):
    # a fresh prompt and chunks after a cached prefix, one of them a single token
    block_size, head_dim, num_heads, num_kv_heads = 16, 64, 4, 2
    seqlens_q, seqlens_k = [9, 1, 20], [9, 33, 50]
    k_cache, v_cache, block_tables = fp8_paged_kv(paged_kv, seqlens_k, block_size, num_kv_heads, head_dim)
    k_scale, v_scale = scales()
    cu_seqlens_q = torch.tensor([0] + seqlens_q).cumsum(0, dtype=torch.int32)
    cu_seqlens_k = torch.tensor([0] + seqlens_k).cumsum(0, dtype=torch.int32)
    q = torch.randn(sum(seqlens_q), num_heads, head_dim).to(dtype)
    out = paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, block_tables, head_dim**-0.5,
                                  max(seqlens_q), k_scale=k_scale, v_scale=v_scale)
    assert out.dtype == dtype and not out.isnan().any()
    keys, values = read_back(k_cache, k_scale), read_back(v_cache, v_scale)
    for b, n in enumerate(seqlens_k):
        rows = slice(cu_seqlens_q[b], cu_seqlens_q[b + 1])
        ref = ref_attention(q[rows], keys, values, block_tables[b].clamp(min=0), n, head_dim**-0.5)
        assert rel_err(out[rows], ref) < tol
