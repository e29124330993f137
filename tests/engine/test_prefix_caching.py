"""Exact prefix reuse end to end: greedy tokens equal transformers' and a cache-off run, and
num_cached_tokens is exact, for prefixes ending around a block edge and mid-block, full repeats and
requests sharing a prefix admitted together."""
import pytest

from tests.conftest import TP_MODEL, hf_greedy, random_prompts
from tpengine import LLM, SamplingParams
from tpengine.kernels.cpu.build import has_compiler

VOCAB = TP_MODEL["vocab_size"]


def prompts_and_expected_hits(block_size: int, base: list[int], first_token: int):
    """Prompts sharing heads of base (cached) or of one new prefix (shared within the batch), and the
    exact number of cached tokens each must report; first_token is what base's run generated first."""
    shared = random_prompts(block_size + 1, [block_size + 5], VOCAB)[0]
    cuts = [block_size - 1, block_size, block_size + 1, block_size + block_size // 2]
    prompts = [base[:cut] + [(base[cut] + 1) % VOCAB, 5, 6] for cut in cuts]  # diverge right after the cut
    prompts += [base, base + [(first_token + 1) % VOCAB]]  # a full repeat; base and one new token
    prompts += [shared + [i + 1, 9] for i in range(3)]  # three-way sharing, none of it cached yet
    expected = cuts + [len(base) - 1, len(base), 0, len(shared), len(shared)]
    return prompts, expected


def run(model, block_size, max_tokens, **kwargs):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    base = random_prompts(block_size, [2 * block_size + 7], VOCAB)[0]
    with LLM(model, kvcache_block_size=block_size, **kwargs) as llm:
        first = llm.generate([base], params, use_tqdm=False)[0]
        prompts, expected = prompts_and_expected_hits(block_size, base, first.token_ids[0])
        outputs = llm.generate(prompts, params, use_tqdm=False)
        hits = (llm.prefix_cache_queries, llm.prefix_cache_hits)
    return prompts, expected, outputs, hits


CASES = [  # block size, backend, tensor-parallel size
    (16, "torch", 1), (256, "torch", 1), (16, "cpu", 1), (256, "cpu", 1), (16, "torch", 2),
]


@pytest.mark.parametrize("block_size,backend,tp", CASES, ids=[f"bs{b}-{a}-tp{t}" for b, a, t in CASES])
def test_exact_prefix_hits_match_transformers(tiny_model, block_size, backend, tp):
    if backend == "cpu" and not has_compiler():
        pytest.skip("no C++ compiler for the cpu backend")
    device = "cpu" if backend == "cpu" else "auto"  # the cpu backend runs on the host, also where CUDA is
    prompts, expected, outputs, (queries, hits) = run(tiny_model, block_size, 8, attention_backend=backend,
                                                      tensor_parallel_size=tp, device=device)
    assert [o.num_cached_tokens for o in outputs] == expected
    assert hits == sum(expected) and queries == sum(map(len, prompts)) + 2 * block_size + 7
    reference = hf_greedy(tiny_model, prompts, 8)
    for i, (out, ref) in enumerate(zip(outputs, reference, strict=True)):
        assert out.token_ids == ref, f"prompt {i} ({expected[i]} of {len(prompts[i])} cached) diverges"


@pytest.mark.parametrize("block_size", [16, 256])
def test_prefix_caching_off_gives_identical_tokens(tiny_model, block_size):
    _, expected, cached, _ = run(tiny_model, block_size, 8)
    _, _, uncached, (_, hits) = run(tiny_model, block_size, 8, enable_prefix_caching=False)
    assert hits == 0 and [o.num_cached_tokens for o in uncached] == [0] * len(expected)
    assert [o.token_ids for o in cached] == [o.token_ids for o in uncached]


def test_exact_prefix_hits_match_transformers_with_triton(tiny_model):
    # on CPU the kernels run in the Triton interpreter: slow, so block 16 and few tokens
    prompts, expected, outputs, _ = run(tiny_model, 16, 3, attention_backend="triton")
    assert [o.num_cached_tokens for o in outputs] == expected
    assert [o.token_ids for o in outputs] == hf_greedy(tiny_model, prompts, 3)
