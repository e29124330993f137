"""The torch backend, the reference for the others, against a naive float64 attention."""
import torch

from tests.conftest import relative_error
from tests.attention.paged_batch import paged_batch, reference_attention
from tpengine.attention.torch_backend import TorchAttentionBackend

TOLERANCE = 1e-5


def run(batch):
    return TorchAttentionBackend().forward(batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta,
                                           batch.params)


def test_prefill_without_cached_prefix_matches_reference():
    batch = paged_batch([(0, 5), (0, 17), (0, 1)])
    assert relative_error(run(batch), reference_attention(batch)) < TOLERANCE


def test_prefill_with_cached_prefix_matches_reference():
    # a block-aligned prefix hit, a mid-block chunk boundary, a one-token chunk, and a sequence with no prefix
    batch = paged_batch([(16, 5), (20, 7), (37, 1), (0, 9)], seed=1)
    assert batch.meta.has_cached_prefix
    assert relative_error(run(batch), reference_attention(batch)) < TOLERANCE


def test_decode_matches_reference():
    batch = paged_batch([(0, 1), (15, 1), (16, 1), (39, 1)], decode=True, seed=2)
    assert relative_error(run(batch), reference_attention(batch)) < TOLERANCE


def test_store_writes_each_new_key_to_its_slot_and_skips_padding():
    batch = paged_batch([(3, 4)], seed=3)
    batch.meta.slot_mapping[-1] = -1  # the last new token is padding: it owns no slot
    before_k, before_v = batch.k_cache.clone(), batch.v_cache.clone()
    TorchAttentionBackend().store_kvcache(batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    slots = batch.meta.slot_mapping[:-1]
    for cache, before, new in ((batch.k_cache, before_k, batch.k), (batch.v_cache, before_v, batch.v)):
        flat, flat_before = cache.flatten(0, 1), before.flatten(0, 1)
        assert torch.equal(flat[slots], new[:-1])
        assert torch.equal(flat.index_fill(0, slots, 0), flat_before.index_fill(0, slots, 0))  # nothing else
