"""The Triton backend equals the torch backend on the same paged inputs (on CPU: TRITON_INTERPRET=1, set by
tests/conftest.py)."""
import pytest
import torch

from tests.conftest import relative_error
from tests.attention.paged_batch import forward_each, paged_batch
from tpengine.attention.torch_backend import TorchAttentionBackend

pytest.importorskip("triton")
from tpengine.attention.triton_backend import TritonAttentionBackend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = 1e-4


def forward_both(batch):
    return forward_each(batch, TorchAttentionBackend(), TritonAttentionBackend())


@pytest.mark.parametrize("seqs", [[(0, 5), (0, 17)], [(16, 5), (20, 7), (0, 3)]], ids=["fresh", "cached_prefix"])
def test_prefill_equals_torch_backend(seqs):
    batch = paged_batch(seqs, head_dim=48, device=DEVICE, seed=4)  # head_dim 48: not a power of two
    (ref, ref_k, ref_v), (out, k_cache, v_cache) = forward_both(batch)
    assert relative_error(out, ref) < TOLERANCE
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_decode_equals_torch_backend():
    batch = paged_batch([(0, 1), (16, 1), (70, 1)], decode=True, head_dim=48, device=DEVICE, seed=5)
    (ref, ref_k, ref_v), (out, k_cache, v_cache) = forward_both(batch)
    assert relative_error(out, ref) < TOLERANCE
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_end_to_end_greedy_with_prefix_hits_matches_transformers(tiny_model):
    # On CPU this runs the kernels in the Triton interpreter: slow, so few short prompts.
    from tests.conftest import TP_MODEL, hf_greedy, random_prompts
    from tpengine import LLM, SamplingParams

    prompts = random_prompts(12, [3, 20, 40], TP_MODEL["vocab_size"])
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    with LLM(tiny_model, kvcache_block_size=16, attention_backend="triton") as llm:
        assert llm.executor.runner.backend_name == "triton"
        first = llm.generate(prompts, params, use_tqdm=False)
        second = llm.generate(prompts, params, use_tqdm=False)
    expected = hf_greedy(tiny_model, prompts, 5)
    assert [o.token_ids for o in first] == expected
    assert [o.token_ids for o in second] == expected
    # exact reuse, all but each prompt's last token: the copied block heads too (the seed's whole blocks
    # gave [0, 16, 32])
    assert [o.num_cached_tokens for o in second] == [2, 19, 39]
