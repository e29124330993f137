"""The C++ paged decode attention for the CPU against the PyTorch reference the Triton kernel tests use."""
import pytest
import torch

from tpengine.kernels.cpu.build import has_compiler
from tpengine.kernels.cpu.paged_decode_attention import paged_decode_attention

# skipped only where there is no compiler: a kernel that fails to build here is a failure
pytestmark = pytest.mark.skipif(not has_compiler(), reason="no C++ compiler here")


@pytest.mark.parametrize(
    "block_size, head_dim, num_heads, num_kv_heads, context_lens, dtype, tol",
    [
        # context 1, exactly a block, a block + 1, several blocks
        (16, 64, 2, 2, [1, 16, 17, 70], torch.float32, 1e-5),
        (32, 48, 4, 2, [33, 5], torch.float32, 1e-5),
        (256, 64, 8, 4, [256, 257, 384, 1], torch.float32, 1e-5),
        (16, 96, 8, 2, [40, 3, 100], torch.float32, 1e-5),
        (256, 128, 4, 1, [300, 9], torch.bfloat16, 2e-2),
        (16, 128, 4, 1, [40, 3], torch.float16, 2e-3),
        # one sequence: its KV heads are the work items; bfloat16 widened 16 at a time, and head_dim 48 not
        (16, 64, 8, 4, [70], torch.bfloat16, 2e-2),
        (16, 48, 8, 4, [70], torch.bfloat16, 2e-2),
        # groups of 3 (an odd group's last head alone), of 1, head_dim 256, float16 widened
        (16, 64, 9, 3, [50, 7], torch.float32, 1e-5),
        (16, 128, 8, 8, [33], torch.float16, 2e-3),
        (256, 256, 4, 2, [300], torch.bfloat16, 2e-2),
    ],
)
def test_matches_reference(block_size, head_dim, num_heads, num_kv_heads, context_lens, dtype, tol, check_decode):
    check_decode(paged_decode_attention, block_size, head_dim, num_heads, num_kv_heads, context_lens, dtype, tol)


@pytest.mark.parametrize("features", [dict(window=20), dict(window=1), dict(window=300), dict(softcap=3.0),
                                      dict(sinks=True), dict(window=33, softcap=2.0, sinks=True)], ids=str)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_window_softcap_and_sinks_match_reference(features, dtype, tol, check_decode):
    # contexts shorter than, equal to and longer than each window, ending mid-block and on a block's end
    check_decode(paged_decode_attention, 16, 64, 8, 2, [1, 20, 33, 64, 70, 100], dtype, tol, **features)


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
@pytest.mark.parametrize("context_lens", [[300], [300, 9], [130], [1], [200, 1]])
def test_fewer_sequences_than_threads_split_their_keys_into_runs(threads, context_lens, check_decode):
    # up to 4 runs of 16-key multiples (64 keys at least): uneven ones, empty ones (a context shorter than the
    # runs), contexts too short to split, windows, sinks and soft caps joined across runs
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_decode(paged_decode_attention, 16, 128, 6, 3, context_lens, torch.float32, 1e-5)
        check_decode(paged_decode_attention, 16, 128, 6, 3, context_lens, torch.bfloat16, 2e-2, window=33)
        check_decode(paged_decode_attention, 16, 64, 8, 2, context_lens, torch.float32, 1e-5, softcap=3.0, sinks=True)
    finally:
        torch.set_num_threads(previous)


def test_empty_context_row_is_zero_and_leaves_its_neighbour_alone(check_empty_context):
    check_empty_context(paged_decode_attention)


def test_writes_into_a_given_output(ref_attention):
    k_cache, v_cache = torch.randn(2, 2, 16, 1, 32).unbind(0)
    q = torch.randn(1, 2, 32)
    out = torch.full_like(q, float("nan"))
    block_table = torch.tensor([[1]], dtype=torch.int32)
    result = paged_decode_attention(q, k_cache, v_cache, block_table, torch.tensor([5], dtype=torch.int32), 0.2,
                                    out=out)
    assert result is out
    assert torch.allclose(out.double(), ref_attention(q, k_cache, v_cache, block_table[0], 5, 0.2), atol=1e-5)


@pytest.mark.parametrize("bad, message", [
    (dict(context_lens=torch.tensor([17], dtype=torch.int32)), "outside 0..16"),
    (dict(block_tables=torch.tensor([[2]], dtype=torch.int32)), "outside the cache's 2 blocks"),
    (dict(block_tables=torch.tensor([[-1]], dtype=torch.int32)), "outside the cache's 2 blocks"),
    (dict(block_tables=torch.zeros(1, 1, dtype=torch.int64)), "int32"),
    (dict(k_cache=torch.randn(2, 16, 3, 32)), "multiple of num_kv_heads"),
    (dict(q=torch.randn(1, 2, 16)), "head_dim"),
])
def test_rejects_what_it_cannot_read(bad, message):
    args = dict(q=torch.randn(1, 2, 32), k_cache=torch.randn(2, 16, 1, 32), v_cache=torch.randn(2, 16, 1, 32),
                block_tables=torch.zeros(1, 1, dtype=torch.int32), context_lens=torch.ones(1, dtype=torch.int32),
                scale=0.2)
    args.update(bad)
    if "k_cache" in bad:
        args["v_cache"] = bad["k_cache"].clone()
    with pytest.raises(RuntimeError, match=message):
        paged_decode_attention(**args)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_values_as_the_first_columns_of_the_keys(threads, dtype, tol, paged_kv, rel_err, ref_attention):
    # DeepSeek's latent cache: one vector per token (latent, then rotary key) is the key, and its latent columns,
    # a view, the value; a run split across threads too
    cache, _, block_tables = paged_kv([1, 130, 17], 16, 1, 48 + 8, dtype)
    q = torch.randn(3, 5, 48 + 8, dtype=dtype)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = paged_decode_attention(q, cache, cache[..., :48], block_tables, torch.tensor([1, 130, 17],
                                                                                          dtype=torch.int32), 0.3)
    finally:
        torch.set_num_threads(previous)
    assert out.shape == (3, 5, 48)
    clean = cache.nan_to_num()
    for b, n in enumerate([1, 130, 17]):
        ref = ref_attention(q[b:b + 1], clean, clean[..., :48], block_tables[b].clamp(min=0), n, 0.3)
        assert rel_err(out[b:b + 1], ref) < tol
