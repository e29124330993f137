"""The latent decode kernel (DeepSeek's absorbed MLA) equals the reference attention over the same cached vectors,
each being a key and, its latent columns, a value: split or not, heads past a multiple of its tile, an empty
context, and the Triton backend's latent decode equals the torch backend's."""
import pytest
import torch

from tests.attention.paged_batch import paged_batch
from tests.kernels.conftest import DEVICE
from tests.reference_attention import paged_attention as reference_paged_attention
from tpengine.attention.backend import AttentionParams
from tpengine.kernels.triton.latent_decode_attention import latent_decode_attention

pytestmark = pytest.mark.usefixtures("triton_device")
LATENT, ROPE = 32, 8


@pytest.mark.parametrize("num_heads, block_size, context_lens, num_splits, dtype, tol", [
    (4, 16, [1, 16, 17, 70], 1, torch.float32, 1e-4),
    (20, 16, [70, 5, 33], 3, torch.float32, 1e-4),    # two head tiles; three splits, some past a short context
    (16, 32, [64, 100], 2, torch.bfloat16, 2e-2),
])
def test_latent_decode_equals_the_reference(num_heads, block_size, context_lens, num_splits, dtype, tol, paged_kv,
                                            rel_err):
    cache, _, block_tables = paged_kv(context_lens, block_size, 1, LATENT + ROPE, dtype)
    q = torch.randn(len(context_lens), num_heads + 1, LATENT + ROPE, dtype=dtype)[:, :num_heads]  # a strided view
    scale = 0.3
    out = latent_decode_attention(q, cache, block_tables, torch.tensor(context_lens, dtype=torch.int32), scale,
                                  LATENT, num_splits=num_splits)
    assert out.shape == (len(context_lens), num_heads, LATENT) and out.dtype == dtype and not out.isnan().any()
    for b, n in enumerate(context_lens):
        clean = cache.nan_to_num()
        ref = reference_paged_attention(q[b:b + 1], clean, clean[..., :LATENT], block_tables[b].clamp(min=0), n, scale)
        assert rel_err(out[b:b + 1], ref) < tol


def test_an_empty_context_gives_zeros(paged_kv):
    cache, _, block_tables = paged_kv([20, 0], 16, 1, LATENT + ROPE, torch.float32)
    out = latent_decode_attention(torch.randn(2, 4, LATENT + ROPE), cache, block_tables,
                                  torch.tensor([20, 0], dtype=torch.int32), 0.2, LATENT, num_splits=2)
    assert not out[0].isnan().any() and torch.equal(out[1], torch.zeros_like(out[1]))


def test_the_triton_backend_decodes_latents_as_the_torch_backend(rel_err):
    from tpengine.attention.torch_backend import TorchAttentionBackend
    from tpengine.attention.triton_backend import TritonAttentionBackend
    batch = paged_batch([(0, 1), (16, 1), (70, 1)], decode=True, head_dim=LATENT + ROPE, num_heads=4,
                        num_kv_heads=1, seed=6, device=DEVICE)
    cache, meta = batch.k_cache, batch.meta
    TorchAttentionBackend().store_kvcache(batch.k, batch.k, cache, cache, meta.slot_mapping)  # the new vectors
    params = AttentionParams(0.25)
    ref = TorchAttentionBackend().decode_latent(batch.q, cache, meta, params, LATENT)
    out = TritonAttentionBackend().decode_latent(batch.q, cache, meta, params, LATENT)
    assert rel_err(out, ref) < 1e-4
