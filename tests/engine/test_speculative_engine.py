"""Speculative decoding end to end on the tiny random model (whose greedy runs fall into loops: the n-gram
proposer's home ground): greedy tokens equal transformers' at tp 1 and 2, block sizes 16 and 256, with
chunked prefill, prefix hits and preemption; every other request gets the tokens it gets without
speculation."""
import pytest

from tests.conftest import TP_MODEL, hf_greedy, random_prompts
from tpengine import LLM, SamplingParams

VOCAB = TP_MODEL["vocab_size"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def prompts_with_a_loop(seed: int) -> list[list[int]]:
    loop = random_prompts(seed + 100, [5], VOCAB)[0] * 4
    return random_prompts(seed, [1, 16, 40, 100], VOCAB) + [loop]


@pytest.mark.parametrize("tp, block_size", [(1, 16), (1, 256), (2, 16), (2, 256)])
def test_greedy_with_speculation_equals_transformers_with_chunked_prefill_and_prefix_hits(tiny_model, tp,
                                                                                          block_size):
    prompts = prompts_with_a_loop(tp)
    expected = hf_greedy(tiny_model, prompts, GREEDY.max_tokens)
    with LLM(tiny_model, tensor_parallel_size=tp, kvcache_block_size=block_size, max_num_batched_tokens=48,
             max_model_len=256, speculative_config=NGRAM) as llm:
        first = llm.generate(prompts, GREEDY, use_tqdm=False)
        second = llm.generate(prompts, GREEDY, use_tqdm=False)  # prefix hits
        stats = llm.spec_decode_stats
    assert [o.outputs[0].token_ids for o in first] == expected
    assert [o.outputs[0].token_ids for o in second] == expected
    assert sum(o.num_cached_tokens for o in second) > 0
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    assert sum(stats["num_accepted_tokens_per_pos"]) == stats["num_accepted_tokens"]


def test_greedy_with_speculation_equals_transformers_through_preemptions(tiny_model):
    prompts = prompts_with_a_loop(7) + random_prompts(8, [30, 50], VOCAB)
    expected = hf_greedy(tiny_model, prompts, GREEDY.max_tokens)
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=12, max_model_len=256,
             speculative_config=NGRAM) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert llm.num_preemptions > 0 and llm.spec_decode_stats["num_accepted_tokens"] > 0
        assert llm.kv_cache_usage == 0.0
    assert [o.outputs[0].token_ids for o in outputs] == expected


def mixed_requests(expected_stop: int) -> list[SamplingParams]:
    """Seeded sampling (with and without a filter), a stop token, max_tokens, EOS, n > 1, and the features that
    decode one token a step (penalties, min_tokens, logprobs)."""
    return [
        SamplingParams(temperature=0.8, seed=1, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=1.2, top_p=0.8, seed=2, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[expected_stop]),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30),
        SamplingParams(temperature=0.7, seed=3, n=2, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, min_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0.5, seed=4, max_tokens=10, logprobs=2, ignore_eos=True),
    ]


@pytest.mark.parametrize("tp", [1, 2])
def test_every_request_gets_the_tokens_it_gets_without_speculation(tiny_model, tp):
    loop_prompt = prompts_with_a_loop(3)[-1]
    greedy = hf_greedy(tiny_model, [loop_prompt], 30)[0]
    params = mixed_requests(expected_stop=greedy[12])
    prompts = [loop_prompt] * len(params)
    results = []
    for spec in (None, NGRAM):
        with LLM(tiny_model, tensor_parallel_size=tp, kvcache_block_size=16, max_model_len=256,
                 speculative_config=spec) as llm:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            if spec is not None:
                assert llm.spec_decode_stats["num_accepted_tokens"] > 0
        results.append([[(c.token_ids, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs]
                        for o in outputs])
    assert results[0] == results[1]
    assert results[1][2][0][0][-1] == greedy[12] and results[1][2][0][1] == "stop"
