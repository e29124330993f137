"""/v1/completions with echo and logprobs: the prompt's tokens scored in vLLM's shape (the first one null), against
transformers' own log-softmax on the same checkpoint; max_tokens 0 scores the prompt alone (lm-eval-harness's
loglikelihood requests), streaming puts the prompt's logprobs in the first chunk."""
import functools

import openai
import pytest
import torch

from tests.conftest import _hf_model

PROMPTS = ["The quick brown fox jumps over the lazy dog", "Tensor parallel", "ab"]
TOP = 3
TOLERANCE = 1e-4
SCORING = dict(model="tiny", echo=True, logprobs=TOP, temperature=0.0,
               extra_body={"ignore_eos": True, "return_token_ids": True})


@functools.lru_cache(maxsize=None)
def reference_logprobs(model: str, token_ids: tuple[int, ...]) -> torch.Tensor:
    """transformers' log-softmax: row i scores the token after position i."""
    with torch.inference_mode():
        return torch.log_softmax(_hf_model(model)(torch.tensor([token_ids])).logits[0].float(), dim=-1)


@functools.lru_cache(maxsize=None)
def token_text(model: str, token_id: int) -> str:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model).decode([token_id])


def expected_top(model: str, row: torch.Tensor, token_id: int) -> dict[str, float]:
    """The token and the TOP likeliest, keyed by text; where two read the same the likelier one's value stays."""
    ids = {token_id, *row.topk(TOP).indices.tolist()}
    assert TOP <= len(ids) <= TOP + 1
    return {token_text(model, t): row[t].item() for t in sorted(ids, key=lambda t: row[t].item())}


def assert_prompt_scored_as_transformers(model: str, logprobs, prompt_token_ids: list[int]) -> None:
    reference = reference_logprobs(model, tuple(prompt_token_ids))
    n = len(prompt_token_ids)
    assert logprobs.tokens[:n] == [token_text(model, t) for t in prompt_token_ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for position in range(1, n):
        row, token_id = reference[position - 1], prompt_token_ids[position]
        assert abs(logprobs.token_logprobs[position] - row[token_id].item()) <= TOLERANCE
        expected = expected_top(model, row, token_id)
        top = logprobs.top_logprobs[position]
        # the token and TOP others (fewer keys only where the byte tokenizer reads two bytes alike, as U+FFFD)
        assert top.keys() == expected.keys()
        assert all(abs(top[text] - expected[text]) <= TOLERANCE for text in top)


def assert_offsets_follow_tokens(logprobs) -> None:
    assert logprobs.text_offset[0] == 0
    for i in range(1, len(logprobs.tokens)):
        assert logprobs.text_offset[i] == logprobs.text_offset[i - 1] + len(logprobs.tokens[i - 1])


def test_echo_with_max_tokens_0_scores_each_prompt_alone_as_transformers(client, tied_model):
    response = client.completions.create(prompt=PROMPTS, max_tokens=0, **SCORING)
    assert [choice.index for choice in response.choices] == [0, 1, 2]
    for prompt, choice in zip(PROMPTS, response.choices):
        assert choice.text == prompt and choice.finish_reason == "length" and choice.token_ids == []
        assert "".join(choice.logprobs.tokens) == prompt and len(choice.logprobs.tokens) == len(choice.prompt_token_ids)
        assert_prompt_scored_as_transformers(tied_model, choice.logprobs, choice.prompt_token_ids)
        assert_offsets_follow_tokens(choice.logprobs)
    assert response.usage.completion_tokens == 0
    assert response.usage.prompt_tokens == sum(len(choice.prompt_token_ids) for choice in response.choices)


def test_echo_with_generation_scores_the_prompt_then_the_completion(client, tied_model):
    response = client.completions.create(prompt=PROMPTS[:2], max_tokens=4, n=2, **SCORING)
    plain = client.completions.create(prompt=PROMPTS[:2], max_tokens=4, n=2, **{**SCORING, "echo": False})
    assert len(response.choices) == 4
    for choice, alone in zip(response.choices, plain.choices):
        n = len(choice.prompt_token_ids)
        assert choice.text == PROMPTS[choice.index // 2] + alone.text and len(choice.logprobs.tokens) == n + 4
        assert_prompt_scored_as_transformers(tied_model, choice.logprobs, choice.prompt_token_ids)
        # the completion's part: what the request without echo gets
        assert choice.logprobs.tokens[n:] == alone.logprobs.tokens
        assert choice.logprobs.token_logprobs[n:] == pytest.approx(alone.logprobs.token_logprobs, abs=TOLERANCE)
        assert_offsets_follow_tokens(choice.logprobs)


def test_streamed_echo_puts_the_prompt_logprobs_in_the_first_chunk(client, tied_model):
    for max_tokens in (0, 4):
        whole = client.completions.create(prompt=PROMPTS[0], max_tokens=max_tokens, **SCORING).choices[0]
        chunks = [chunk.choices[0] for chunk in
                  client.completions.create(prompt=PROMPTS[0], max_tokens=max_tokens, stream=True, **SCORING)]
        assert chunks[0].text.startswith(PROMPTS[0])
        assert_prompt_scored_as_transformers(tied_model, chunks[0].logprobs, whole.prompt_token_ids)
        assert "".join(chunk.text for chunk in chunks) == whole.text
        assert [t for chunk in chunks for t in chunk.logprobs.tokens] == whole.logprobs.tokens
        streamed = [lp for chunk in chunks for lp in chunk.logprobs.token_logprobs]
        assert streamed[0] is None and streamed[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=TOLERANCE)
        assert chunks[-1].finish_reason == "length"


def test_echo_with_max_tokens_0_and_no_logprobs_returns_the_prompt(client):
    choice = client.completions.create(model="tiny", prompt=[PROMPTS[1]], max_tokens=0, echo=True).choices[0]
    assert choice.text == PROMPTS[1] and choice.logprobs is None and choice.finish_reason == "length"


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 0, "logprobs": 1}, "max_tokens"),
    ({"max_tokens": 0, "echo": True, "logprobs": 21}, "logprobs"),
    ({"max_tokens": -1, "echo": True}, "max_tokens"),
])
def test_max_tokens_0_without_echo_and_bad_logprobs_are_400s_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="tiny", prompt="score me", **body)
    assert error.value.body["param"] == param and param in error.value.body["message"]
