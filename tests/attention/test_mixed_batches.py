"""A mixed step (decode tokens first, then prefill chunks, in one forward) on every attention backend that
runs here: each row equals a float64 reference, and the cache holds every row's new K/V."""
import importlib.util

import pytest
import torch

from tests.attention.paged_batch import mixed_batch, reference_attention
from tests.conftest import relative_error
from tpengine.attention import make_backend
from tpengine.kernels.cpu.build import has_compiler

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = 1e-4
BACKENDS = [
    "torch",
    pytest.param("cpu", marks=pytest.mark.skipif(DEVICE != "cpu" or not has_compiler(),
                                                 reason="the cpu backend needs the CPU and a C++ compiler")),
    pytest.param("triton", marks=pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                                    reason="needs triton")),
]
# decode rows over 1, 16 and 70 cached tokens; chunks fresh, after a cached prefix (17 rows: the CPU's SDPA over
# the gathered keys; 5 rows and 1: its decode kernel, a row each)
SEQS = [(0, 1), (15, 1), (69, 1), (0, 9), (32, 17), (40, 5), (20, 1)]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("name", BACKENDS)
def test_mixed_step_rows_equal_the_reference_and_every_row_is_stored(name, block_size):
    batch = mixed_batch(SEQS, 3, block_size=block_size, head_dim=48, device=DEVICE, seed=7)
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    out = make_backend(name).forward(batch.q, batch.k, batch.v, k_cache, v_cache, batch.meta, batch.params)
    assert relative_error(out, reference_attention(batch).to(out.dtype)) < TOLERANCE
    slots = batch.meta.slot_mapping
    assert torch.equal(k_cache.flatten(0, 1)[slots], batch.k) and torch.equal(v_cache.flatten(0, 1)[slots], batch.v)


@pytest.mark.parametrize("features", [dict(window=20), dict(softcap=3.0), dict(sinks=True),
                                      dict(window=9, softcap=2.0, sinks=True)], ids=str)
@pytest.mark.parametrize("name", BACKENDS)
def test_window_softcap_and_sinks_in_mixed_steps_equal_the_reference(name, features):
    batch = mixed_batch(SEQS, 3, block_size=16, head_dim=48, device=DEVICE, seed=8, **features)
    out = make_backend(name).forward(batch.q, batch.k, batch.v, batch.k_cache.clone(), batch.v_cache.clone(),
                                     batch.meta, batch.params)
    assert relative_error(out, reference_attention(batch).to(out.dtype)) < TOLERANCE
