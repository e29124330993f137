"""The checks every family's tests run against transformers' greedy tokens: one generate, the same prompts twice
(the second all prefix hits), and a cache small enough to preempt."""
from tests.conftest import hf_greedy
from tpengine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def assert_parity(path, prompts, outputs, max_tokens=GREEDY.max_tokens, oracle=None):
    """outputs are transformers' greedy tokens for prompts (oracle: another folder transformers reads instead)."""
    expected = hf_greedy(oracle or path, prompts, max_tokens)
    for i, (out, ref) in enumerate(zip(outputs, expected, strict=True)):
        assert out.token_ids == ref, f"prompt {i} (len {len(prompts[i])}) diverges from transformers"


def check_twice_with_prefix_hits(path, prompts, max_tokens=GREEDY.max_tokens, **llm_kwargs):
    """Generate prompts twice in one engine: both runs give transformers' tokens, and the second computes only
    each prompt's last token."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(path, **llm_kwargs) as llm:
        first = llm.generate(prompts, params, use_tqdm=False)
        second = llm.generate(prompts, params, use_tqdm=False)
    assert_parity(path, prompts, first, max_tokens)
    assert_parity(path, prompts, second, max_tokens)
    assert [o.num_cached_tokens for o in second] == [len(p) - 1 for p in prompts]  # all but the last token


def check_preemption(path, prompts, max_tokens, num_kvcache_blocks=8, **llm_kwargs):
    """A cache of num_kvcache_blocks blocks of 16 too small for prompts at once: some preempt, tokens stay exact."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(path, kvcache_block_size=16, num_kvcache_blocks=num_kvcache_blocks, **llm_kwargs) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.scheduler.num_preemptions > 0
    assert_parity(path, prompts, outputs, max_tokens)
