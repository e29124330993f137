"""Request outputs at tp=2 (real workers over gloo): n completions forking the prompt's blocks on every
rank, logprobs, penalties, stop strings, the engine seed, and abort mid-stream, as at tp=1."""
import pytest

from tests.conftest import TP_MODEL, hf_greedy, random_prompts
from tests.engine.test_sampling_features import check_logprobs, hf_greedy_with
from tpengine import LLM, SamplingParams

VOCAB = TP_MODEL["vocab_size"]


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(tiny_model, tensor_parallel_size=2, kvcache_block_size=16, num_kvcache_blocks=64,
             max_model_len=256) as llm:
        yield llm


def test_n_greedy_completions_with_logprobs_match_transformers_at_tp_2(llm, tiny_model):
    prompt = random_prompts(20, [40], VOCAB)[0]
    [out] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, n=3, logprobs=4),
                         use_tqdm=False)
    expected = hf_greedy(tiny_model, [prompt], 6)[0]
    assert [c.token_ids for c in out.outputs] == [expected] * 3
    for completion in out.outputs:
        check_logprobs(tiny_model, prompt, completion, out, 4)


def test_repetition_penalty_matches_transformers_at_tp_2(llm, tiny_model):
    prompt = random_prompts(21, [12], VOCAB)[0]
    [out] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                                  repetition_penalty=1.7), use_tqdm=False)
    assert out.token_ids == hf_greedy_with(tiny_model, prompt, 10, repetition_penalty=1.7)


def test_sampled_n_with_penalties_and_stops_is_the_same_at_tp_1_and_2(llm, tiny_model):
    prompts = random_prompts(22, [9, 33], VOCAB)
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, ignore_eos=True, n=2, seed=5,
                            presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1, stop=["a", "Q"])
    unseeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)

    def run(engine):
        seeded = engine.generate(prompts, params, use_tqdm=False)
        return ([[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in seeded],
                [o.token_ids for o in engine.generate(prompts, unseeded, use_tqdm=False)])

    # a fresh tp=2 engine, so both engines' seeded generators start at the same state
    with LLM(tiny_model, tensor_parallel_size=2, kvcache_block_size=16, num_kvcache_blocks=64,
             max_model_len=256) as engine:
        at_tp_2 = run(engine)
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256) as engine:
        at_tp_1 = run(engine)
    assert at_tp_1 == at_tp_2
    assert all(first[0] != second[0] for first, second in at_tp_1[0])  # the two completions differ


def test_abort_in_the_middle_of_a_stream_at_tp_2(llm):
    request_id = llm.add_request(random_prompts(23, [20], VOCAB)[0], SamplingParams(temperature=0.0, max_tokens=40,
                                                                                    stop=["never"]))
    for _ in range(3):
        [out] = llm.step()
        assert not out.finished
    aborted = llm.abort(request_id)
    assert aborted.finish_reason == "abort" and len(aborted.token_ids) == 3 and llm.kv_cache_usage == 0.0
    assert [o.finished for o in llm.step()] == [True] and not llm.has_unfinished_requests()
    [after] = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(after.token_ids) == 3
