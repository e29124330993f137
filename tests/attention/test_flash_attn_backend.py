"""The flash-attn backend equals the torch backend on the same paged inputs, and runs the engine (CUDA only)."""
import importlib.util

import pytest
import torch

from tests.conftest import relative_error
from tests.attention.paged_batch import forward_each, paged_batch
from tests.conftest import TP_MODEL, random_prompts
from tpengine import LLM, SamplingParams
from tpengine.attention.torch_backend import TorchAttentionBackend

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("flash_attn") is None,
                                reason="needs CUDA and flash-attn")

BLOCK_SIZE = 256  # flash-attn's paged KV needs a multiple of 256
TOLERANCE = 2e-2  # bfloat16


def forward_both(batch):
    from tpengine.attention.flash_attn_backend import FlashAttnBackend
    return forward_each(batch, TorchAttentionBackend(), FlashAttnBackend())


@pytest.mark.parametrize("seqs", [[(0, 5), (0, 300)], [(256, 5), (300, 40), (0, 3)]], ids=["fresh", "cached_prefix"])
def test_prefill_equals_torch_backend(seqs):
    batch = paged_batch(seqs, block_size=BLOCK_SIZE, num_heads=8, num_kv_heads=2, head_dim=128,
                        dtype=torch.bfloat16, device="cuda", seed=6)
    (ref, ref_k, ref_v), (out, k_cache, v_cache) = forward_both(batch)
    assert relative_error(out, ref) < TOLERANCE
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_decode_equals_torch_backend():
    batch = paged_batch([(0, 1), (255, 1), (600, 1)], decode=True, block_size=BLOCK_SIZE, num_heads=8,
                        num_kv_heads=2, head_dim=128, dtype=torch.bfloat16, device="cuda", seed=7)
    (ref, ref_k, ref_v), (out, k_cache, v_cache) = forward_both(batch)
    assert relative_error(out, ref) < TOLERANCE
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_engine_tokens_with_cuda_graphs_equal_eager_ones(tiny_model):
    # four prompts of one length: every decode batch fills bucket 4 exactly, so the graphs run the very
    # shapes eager runs and the tokens must be identical, bfloat16 or not
    prompts = random_prompts(8, [20, 20, 20, 20], TP_MODEL["vocab_size"])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for eager in (True, False):
        with LLM(tiny_model, dtype="bfloat16", attention_backend="flash_attn", kvcache_block_size=BLOCK_SIZE,
                 enforce_eager=eager) as llm:
            assert (llm.executor.runner.decode_path.replays is None) == eager
            tokens[eager] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens[False] == tokens[True]
