"""LLM.beam_search equals transformers' beam search (generate(num_beams=beam_width, do_sample=False), float32) on
the tiny model: every returned beam, in order, and its score, with and without EOS, for each early_stopping and
length penalty."""
import json
import os
import shutil

import pytest
import torch

from tests.conftest import TP_MODEL, _hf_model, hf_greedy, random_prompts
from tpengine import LLM, BeamSearchParams
from tpengine.sampling_params import MAX_LOGPROBS

VOCAB = TP_MODEL["vocab_size"]
EOS_PROMPT = random_prompts(3, [5], VOCAB)[0]
# Made end-of-sequence tokens of the tiny model, where its beams for EOS_PROMPT pass them: beams end at several
# lengths, and each early_stopping returns other beams (test_each_early_stopping_returns_other_beams_here)
EOS_TOKEN_IDS = [338, 442]


def hf_beam_search(path: str, prompt: list[int], params: BeamSearchParams,
                   eos_token_ids: list[int] | None) -> list[tuple[list[int], float]]:
    """transformers' beams, best first: each one's output tokens (through the EOS that ended it) and score."""
    width = params.beam_width
    with torch.inference_mode():
        out = _hf_model(path).generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), num_beams=width,
            num_return_sequences=width, do_sample=False, max_new_tokens=params.max_tokens,
            early_stopping=params.early_stopping, length_penalty=params.length_penalty, eos_token_id=eos_token_ids,
            pad_token_id=0, return_dict_in_generate=True, output_scores=True)
    beams = []
    for tokens, score in zip(out.sequences[:, len(prompt):].tolist(), out.sequences_scores.tolist()):
        end = next((i + 1 for i, t in enumerate(tokens) if t in (eos_token_ids or ())), len(tokens))
        beams.append((tokens[:end], score))
    return beams


def assert_transformers_beams(path, prompts, outputs, params, eos_token_ids=None):
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = hf_beam_search(path, prompt, params, eos_token_ids)
        assert [s.tokens[len(prompt):] for s in output.sequences] == [tokens for tokens, _ in expected]
        for sequence, (tokens, score) in zip(output.sequences, expected):
            assert sequence.tokens[:len(prompt)] == prompt
            assert sequence.cum_logprob / len(tokens) ** params.length_penalty == pytest.approx(score, rel=1e-4)
            # each output token's logprob is in its step's candidates, and they add up to cum_logprob
            assert len(sequence.logprobs) == len(tokens)
            assert sum(step[t] for step, t in zip(sequence.logprobs, tokens)) == pytest.approx(sequence.cum_logprob)


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(tiny_model, kvcache_block_size=16) as llm:
        yield llm


@pytest.fixture(scope="module")
def eos_model(tiny_model, tmp_path_factory) -> str:
    """The tiny model with EOS_TOKEN_IDS as its end-of-sequence tokens (generation_config.json's)."""
    path = str(tmp_path_factory.mktemp("eos_model") / "model")
    shutil.copytree(tiny_model, path)
    generation_config = os.path.join(path, "generation_config.json")
    with open(generation_config) as f:
        settings = json.load(f)
    with open(generation_config, "w") as f:
        json.dump({**settings, "eos_token_id": EOS_TOKEN_IDS}, f)
    return path


@pytest.fixture(scope="module")
def eos_llm(eos_model):
    with LLM(eos_model, kvcache_block_size=16) as llm:
        yield llm


@pytest.mark.parametrize("beam_width, max_tokens", [(2, 6), (4, 8)])
def test_beams_equal_transformers_when_eos_is_ignored(llm, tiny_model, beam_width, max_tokens):
    prompts = random_prompts(3, [5, 17, 30], VOCAB)
    params = BeamSearchParams(beam_width=beam_width, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    assert_transformers_beams(tiny_model, prompts, outputs, params)
    tokenizer = llm.get_tokenizer()
    for sequence in (s for output in outputs for s in output.sequences):
        assert sequence.finish_reason == "length" and sequence.text == tokenizer.decode(sequence.tokens)


@pytest.mark.parametrize("length_penalty", [1.0, 2.0, 0.5])
@pytest.mark.parametrize("early_stopping", [False, True, "never"])
def test_beams_equal_transformers_when_beams_end_on_eos(eos_llm, eos_model, early_stopping, length_penalty):
    params = BeamSearchParams(beam_width=3, max_tokens=10, early_stopping=early_stopping,
                              length_penalty=length_penalty)
    outputs = eos_llm.beam_search([EOS_PROMPT], params)
    assert_transformers_beams(eos_model, [EOS_PROMPT], outputs, params, EOS_TOKEN_IDS)


def test_each_early_stopping_returns_other_beams_here(eos_model):
    # keeps test_beams_equal_transformers_when_beams_end_on_eos to its point: the three rules disagree on this case
    beams = [hf_beam_search(eos_model, EOS_PROMPT, BeamSearchParams(3, 10, early_stopping=rule), EOS_TOKEN_IDS)
             for rule in (False, True, "never")]
    assert beams[0] != beams[1] and beams[0] != beams[2] and beams[1] != beams[2]
    assert {len(tokens) for tokens, _ in beams[0]} == {5, 6, 9}


@pytest.mark.parametrize("include_stop_str_in_output", [False, True])
def test_a_beam_ended_by_eos_keeps_its_eos_text_only_when_asked(eos_llm, include_stop_str_in_output):
    params = BeamSearchParams(beam_width=3, max_tokens=10, include_stop_str_in_output=include_stop_str_in_output)
    [output] = eos_llm.beam_search([EOS_PROMPT], params)
    tokenizer = eos_llm.get_tokenizer()
    ended = [s for s in output.sequences if s.finish_reason == "stop"]
    assert ended and all(s.tokens[-1] in EOS_TOKEN_IDS for s in ended)
    for sequence in ended:
        kept = sequence.tokens if include_stop_str_in_output else sequence.tokens[:-1]
        assert sequence.text == tokenizer.decode(kept)


def test_beam_width_one_is_greedy(llm, tiny_model):
    prompts = random_prompts(5, [4, 21], VOCAB)
    outputs = llm.beam_search(prompts, BeamSearchParams(beam_width=1, max_tokens=7, ignore_eos=True))
    assert [o.sequences[0].tokens[len(p):] for p, o in zip(prompts, outputs)] == hf_greedy(tiny_model, prompts, 7)


def test_text_prompts_and_a_concurrency_limit_change_no_beam(llm):
    prompts = ["Hello there", random_prompts(6, [9], VOCAB)[0]]
    params = BeamSearchParams(beam_width=3, max_tokens=4, ignore_eos=True)
    together = llm.beam_search(prompts, params)
    one_at_a_time = llm.beam_search(prompts, params, concurrency_limit=1)
    for alone, grouped in zip(one_at_a_time, together, strict=True):
        assert [s.tokens for s in alone.sequences] == [s.tokens for s in grouped.sequences]
        assert [s.cum_logprob for s in alone.sequences] == pytest.approx([s.cum_logprob for s in grouped.sequences])
    assert together[0].sequences[0].tokens[:11] == llm.get_tokenizer().encode("Hello there")


def test_as_many_beams_as_logprobs_allow_when_eos_is_ignored(llm):
    [output] = llm.beam_search([[1, 2, 3]], BeamSearchParams(beam_width=MAX_LOGPROBS, max_tokens=1, ignore_eos=True))
    assert len(output.sequences) == MAX_LOGPROBS
    scores = [s.cum_logprob for s in output.sequences]
    assert scores == sorted(scores, reverse=True)


@pytest.mark.parametrize("settings, match", [
    (dict(beam_width=0, max_tokens=4), r"beam_width must be in \[1, 20\]"),
    (dict(beam_width=MAX_LOGPROBS + 1, max_tokens=4), r"beam_width must be in \[1, 20\]"),
    (dict(beam_width=2, max_tokens=0), "max_tokens must be an integer >= 1"),
    (dict(beam_width=2, max_tokens=4, temperature=0.7), "temperature must be 0"),
    (dict(beam_width=2, max_tokens=4, length_penalty=float("inf")), "length_penalty must be finite"),
    (dict(beam_width=2, max_tokens=4, early_stopping="sometimes"), "early_stopping must be True, False or 'never'"),
    (dict(beam_width=2, max_tokens=4, ignore_eos=1), "ignore_eos must be True or False"),
])
def test_bad_beam_search_params_are_value_errors_naming_the_limit(settings, match):
    with pytest.raises(ValueError, match=match):
        BeamSearchParams(**settings)


def test_bad_beam_search_calls_are_value_errors_naming_the_limit(llm):
    # the model's EOS token takes one of each beam's MAX_LOGPROBS candidates
    with pytest.raises(ValueError, match=r"beam_width=20 needs each beam's 21 likeliest tokens .* limit of 20"):
        llm.beam_search([[1, 2]], BeamSearchParams(beam_width=MAX_LOGPROBS, max_tokens=2))
    with pytest.raises(ValueError, match=r"prompt 1: prompt token id 5000 is outside the vocabulary"):
        llm.beam_search([[1, 2], [5000]], BeamSearchParams(beam_width=2, max_tokens=2))
    with pytest.raises(ValueError, match="params must be a BeamSearchParams"):
        llm.beam_search([[1, 2]], {"beam_width": 2, "max_tokens": 2})
    with pytest.raises(ValueError, match="concurrency_limit must be None or an integer >= 1"):
        llm.beam_search([[1, 2]], BeamSearchParams(beam_width=2, max_tokens=2), concurrency_limit=0)
    with pytest.raises(ValueError, match="lora_request needs an engine made with enable_lora"):
        llm.beam_search([[1, 2]], BeamSearchParams(beam_width=2, max_tokens=2), lora_request=object())
