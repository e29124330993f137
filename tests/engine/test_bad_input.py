"""Bad input gets a ValueError naming the limit; requests already queued still finish."""
import pytest

from tests.conftest import TP_MODEL, hf_greedy, random_prompts
from tpengine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
VOCAB = TP_MODEL["vocab_size"]


@pytest.fixture(scope="module")
def llm(tiny_model):
    # 8 blocks of 16 tokens = 128 tokens of cache; max_model_len 100
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=8, max_model_len=100) as llm:
        yield llm


@pytest.mark.parametrize("prompt, params, message", [
    ([], GREEDY, "prompt is empty"),
    ([5, VOCAB], GREEDY, rf"token id {VOCAB} is outside the vocabulary \[0, {VOCAB}\)"),
    ([5, -1], GREEDY, "token id -1 is outside the vocabulary"),
    (list(range(101)), GREEDY, "prompt has 101 tokens, more than max_model_len=100"),
])
def test_bad_request_raises_value_error_and_others_still_finish(llm, tiny_model, prompt, params, message):
    good = random_prompts(1, [7, 20], VOCAB)
    ids = [llm.add_request(p, GREEDY) for p in good]
    with pytest.raises(ValueError, match=message):
        llm.add_request(prompt, params)
    outputs = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            outputs[out.request_id] = out
    assert sorted(outputs) == sorted(ids)
    assert [outputs[i].token_ids for i in ids] == hf_greedy(tiny_model, good, GREEDY.max_tokens)


def test_request_that_can_never_fit_the_cache_names_the_cache_size(tiny_model):
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=4) as llm:
        with pytest.raises(ValueError, match="only 4 blocks"):
            llm.generate([[1] * 60], SamplingParams(temperature=0, max_tokens=10))


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
    (dict(max_tokens=-3), "max_tokens must be an integer >= 1"),
    (dict(temperature=-1.0), "temperature must be >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
])
def test_bad_sampling_values_raise_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_one_bad_prompt_in_generate_names_it_and_the_engine_stays_usable(llm, tiny_model):
    prompts = random_prompts(2, [5, 9], VOCAB)
    with pytest.raises(ValueError, match="prompt 1: prompt is empty"):
        llm.generate([prompts[0], [], prompts[1]], GREEDY, use_tqdm=False)
    assert not llm.has_unfinished_requests()
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == hf_greedy(tiny_model, prompts, GREEDY.max_tokens)


@pytest.mark.parametrize("kwargs, message", [
    (dict(kvcache_block_size=24), "kvcache_block_size must be a power of two >= 16"),
    (dict(kvcache_block_size=8), "kvcache_block_size must be a power of two >= 16"),
    (dict(attention_backend="flash_attn", device="cpu"), "needs CUDA"),
    (dict(max_num_seqs=0), "max_num_seqs must be an integer >= 1"),
    (dict(dtype="float8"), "dtype must be one of"),
])
def test_bad_engine_settings_raise_value_error(tiny_model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_model, **kwargs)


def test_generation_stops_at_max_model_len_with_reason_length(llm):
    [out] = llm.generate([[3] * 95], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), use_tqdm=False)
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_stop_token_and_eos_end_a_request_with_reason_stop(tiny_model, llm):
    prompt = random_prompts(3, [12], VOCAB)[0]
    expected = hf_greedy(tiny_model, [prompt], 6)[0]
    stop_at = expected[3]
    cut = expected.index(stop_at) + 1
    [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, stop_token_ids=(stop_at,)),
                         use_tqdm=False)
    assert out.token_ids == expected[:cut] and out.finish_reason == "stop"
    scheduler, = llm.scheduler.schedulers
    eos_token_ids = scheduler.eos_token_ids
    scheduler.eos_token_ids = frozenset([stop_at])  # as if the checkpoint's EOS were this token
    try:
        [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
        [ignored] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                                 use_tqdm=False)
    finally:
        scheduler.eos_token_ids = eos_token_ids
    assert out.token_ids == expected[:cut] and out.finish_reason == "stop"
    assert ignored.token_ids == expected and ignored.finish_reason == "length"


def test_model_without_tokenizer_takes_token_ids_and_rejects_text(tmp_path, tiny_model):
    from tpengine.tiny_model import write_tiny_model
    path = write_tiny_model(str(tmp_path / "no_tokenizer"), seed=1, with_tokenizer=False, **TP_MODEL)
    prompt = random_prompts(4, [9], VOCAB)[0]
    with LLM(path, kvcache_block_size=16) as llm:
        [out] = llm.generate([prompt], GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match="no tokenizer: pass prompts as lists of token ids"):
            llm.generate(["some text"], GREEDY, use_tqdm=False)
    assert out.text is None
    assert out.token_ids == hf_greedy(tiny_model, [prompt], GREEDY.max_tokens)[0]  # same weights (seed 1)
