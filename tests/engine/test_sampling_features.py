"""logprobs, penalties, min_tokens and stop strings end to end, against transformers (its logits
processors where it has them, a direct reference where it does not); prompt types."""
import numpy as np
import pytest
import torch
from transformers import LogitsProcessorList, MinNewTokensLengthLogitsProcessor

from tests.conftest import TP_MODEL, _hf_model, hf_greedy, random_prompts
from tpengine import LLM, SamplingParams

VOCAB = TP_MODEL["vocab_size"]


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256) as llm:
        yield llm


def hf_logprobs(path, prompt, completion) -> torch.Tensor:
    """float32 log-softmax of transformers' logits at each generated position: [len(completion), vocab]."""
    with torch.inference_mode():
        logits = _hf_model(path)(torch.tensor([prompt + completion[:-1]])).logits[0, len(prompt) - 1:]
    return logits.float().log_softmax(-1)


def hf_greedy_with(path, prompt, max_new_tokens, **generate_kwargs) -> list[int]:
    with torch.inference_mode():
        out = _hf_model(path).generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                       pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                       **generate_kwargs)
    return out[0, len(prompt):].tolist()


def reference_penalized_greedy(path, prompt, max_new_tokens, presence, frequency) -> list[int]:
    """OpenAI's definition, directly: logits -= frequency * count + presence * (count > 0) over generated tokens."""
    generated = []
    for _ in range(max_new_tokens):
        with torch.inference_mode():
            logits = _hf_model(path)(torch.tensor([prompt + generated])).logits[0, -1].float()
        counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=logits.numel()).float()
        logits = logits - frequency * counts - presence * (counts > 0).float()
        generated.append(int(logits.argmax()))
    return generated


def check_logprobs(path, prompt, completion, out, k):
    reference = hf_logprobs(path, prompt, completion.token_ids)
    assert len(completion.logprobs) == len(completion.token_ids)
    total = 0.0
    for j, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        top = reference[j].topk(k)
        assert set(top.indices.tolist()) | {token} == set(entry)
        for token_id, value in entry.items():
            assert abs(value - reference[j, token_id].item()) < 1e-4
        total += entry[token]
    assert completion.cumulative_logprob == pytest.approx(total, abs=1e-6)


def test_greedy_logprobs_equal_transformers_log_softmax_and_the_token_is_the_top_entry(llm, tiny_model):
    prompts = random_prompts(10, [7, 30], VOCAB)
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)]  # did not ask: None
    outputs = llm.generate(prompts, params, use_tqdm=False)
    completion = outputs[0].outputs[0]
    check_logprobs(tiny_model, prompts[0], completion, outputs[0], 3)
    assert all(max(entry, key=entry.get) == token for token, entry in zip(completion.token_ids, completion.logprobs))
    assert outputs[1].outputs[0].logprobs is None and outputs[1].outputs[0].cumulative_logprob is None


def test_sampled_logprobs_come_from_the_raw_distribution_and_hold_the_sampled_token(llm, tiny_model):
    prompt = random_prompts(11, [12], VOCAB)[0]
    [out] = llm.generate([prompt], SamplingParams(temperature=1.5, top_k=50, max_tokens=6, ignore_eos=True,
                                                  logprobs=0, seed=3), use_tqdm=False)
    completion = out.outputs[0]
    check_logprobs(tiny_model, prompt, completion, out, 0)
    assert all(list(entry) == [token] for token, entry in zip(completion.token_ids, completion.logprobs))


def test_repetition_penalty_gives_transformers_greedy_tokens(llm, tiny_model):
    prompts = random_prompts(12, [5, 20], VOCAB)
    for penalty in (1.8, 0.6):
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                                       repetition_penalty=penalty), use_tqdm=False)
        for prompt, out in zip(prompts, outputs):
            assert out.token_ids == hf_greedy_with(tiny_model, prompt, 10, repetition_penalty=penalty)
        assert [o.token_ids for o in outputs] != hf_greedy(tiny_model, prompts, 10)  # it did change something


@pytest.mark.parametrize("presence, frequency", [(1.5, 0.0), (0.0, 2.0), (-1.0, 0.7)])
def test_presence_and_frequency_penalties_match_a_direct_reference(llm, tiny_model, presence, frequency):
    prompt = [3, 3, 3, 9]
    [out] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                                  presence_penalty=presence, frequency_penalty=frequency),
                         use_tqdm=False)
    assert out.token_ids == reference_penalized_greedy(tiny_model, prompt, 10, presence, frequency)


def test_min_tokens_masks_stop_tokens_as_transformers_min_new_tokens_does(llm, tiny_model):
    prompt = random_prompts(13, [9], VOCAB)[0]
    plain = hf_greedy(tiny_model, [prompt], 8)[0]
    stop = plain[1]
    [early] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                    stop_token_ids=[stop]), use_tqdm=False)
    assert early.token_ids == plain[:2] and early.finish_reason == "stop" and early.outputs[0].stop_reason == stop
    [late] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                   stop_token_ids=[stop], min_tokens=5), use_tqdm=False)
    processors = LogitsProcessorList([MinNewTokensLengthLogitsProcessor(len(prompt), 5, [stop])])
    expected = hf_greedy_with(tiny_model, prompt, 12, logits_processor=processors, eos_token_id=stop)
    assert late.token_ids == expected and len(late.token_ids) > 5


def test_stop_string_ends_the_request_in_the_step_it_matches(tied_model):
    with LLM(tied_model, kvcache_block_size=16, num_kvcache_blocks=32, max_model_len=256) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        [plain] = llm.generate(["Hello"], params, use_tqdm=False)
        text = plain.text
        at = next(i for i in range(5, len(text) - 2) if "\ufffd" not in text[i:i + 2])
        stop = text[at:at + 2]  # two byte tokens (or more): spans a token boundary
        request_id = llm.add_request("Hello", SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                              stop=[stop, "never-there"]))
        history = []
        while llm.has_unfinished_requests():
            history += [o for o in llm.step() if o.request_id == request_id]
        final = history[-1].outputs[0]
        assert final.text == text[:text.find(stop)] and final.finish_reason == "stop" and final.stop_reason == stop
        assert len(final.token_ids) < 40 and llm.kv_cache_usage == 0.0
        assert all(final.text.startswith(o.outputs[0].text) for o in history)


def test_prompts_as_arrays_iterables_and_dicts_all_run(llm, tiny_model):
    prompt = random_prompts(14, [10], VOCAB)[0]
    expected = hf_greedy(tiny_model, [prompt], 4)[0]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    forms = [torch.tensor(prompt), np.array(prompt, dtype=np.int32), tuple(prompt), {"prompt_token_ids": prompt},
             [np.int64(t) for t in prompt]]
    for form in forms:
        [out] = llm.generate(form, params, use_tqdm=False)
        assert out.token_ids == expected and out.prompt_token_ids == prompt
    outputs = llm.generate((p for p in [prompt, torch.tensor(prompt)]), params, use_tqdm=False)
    assert [o.token_ids for o in outputs] == [expected, expected]


@pytest.mark.parametrize("prompt, message", [
    (None, "prompts must be a prompt or an iterable of prompts"),
    (b"Hello", "prompts must be a prompt or an iterable of prompts"),
    ([b"Hello"], "a prompt must be a string, a list of token ids"),
    ([None], "a prompt must be a string, a list of token ids"),
    ([[1.0, 2.0]], "prompt token ids must be integers"),
    ([torch.tensor([1.0, 2.0])], "prompt token ids must be integers"),
    ([torch.tensor([True, False])], "prompt token ids must be integers"),
    ([torch.ones(2, 2, dtype=torch.long)], "must be 1-D"),
    ([{"text": "x"}], "a prompt dict needs 'prompt'"),
])
def test_what_is_not_a_prompt_gets_a_value_error_saying_what_is(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.has_unfinished_requests()


def test_sampling_params_that_are_not_sampling_params_are_refused(llm):
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams or a list of them"):
        llm.generate([[1, 2]], {"temperature": 0.0}, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams"):
        llm.add_request([1, 2], {"temperature": 0.0})


@pytest.mark.parametrize("params, message", [
    (SamplingParams(n=100), "n=100 is more than max_num_seqs=64"),
    (SamplingParams(stop_token_ids=[VOCAB]), "stop token id 1003 is outside the vocabulary"),
])
def test_requests_beyond_the_engine_limits_are_refused(tiny_model, params, message):
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=16, max_model_len=64, max_num_seqs=64) as llm:
        with pytest.raises(ValueError, match=message):
            llm.add_request([1, 2], params)


def test_greedy_with_logit_bias_equals_transformers_sequence_bias(llm, tiny_model):
    # transformers' SequenceBiasLogitsProcessor adds a bias to single-token sequences' logits, as logit_bias does
    prompts = random_prompts(11, [7, 12], VOCAB)
    plain = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, plain):
        # ban the first greedy token, push two others up a little: the continuation changes
        bias = {out.token_ids[0]: -100.0, 5: 2.5, 17: 1.0}
        ours = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                     logit_bias={str(t): b for t, b in bias.items()}),
                            use_tqdm=False)[0]
        expected = hf_greedy_with(tiny_model, prompt, 8, sequence_bias={(t,): b for t, b in bias.items()})
        assert ours.token_ids == expected
        assert out.token_ids[0] not in ours.token_ids


def test_logit_bias_forces_a_sampled_token_and_bad_biases_name_the_limit(llm):
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True,
                                                   logit_bias={42: 100.0}), use_tqdm=False)[0]
    assert out.token_ids == [42] * 6
    for bias, message in (({VOCAB: 1.0}, "outside the vocabulary"), ({3: 101.0}, r"\[-100, 100\]"),
                          ({"x": 1.0}, "token ids"), ({3: float("nan")}, r"\[-100, 100\]")):
        with pytest.raises(ValueError, match=message) as error:
            llm.generate([[1, 2]], SamplingParams(logit_bias=bias), use_tqdm=False)
        assert error.value.param == "logit_bias"
