"""/v1/chat/completions: the chat template, streamed deltas with the role first, logprobs."""
import asyncio

import pytest
from transformers import AutoTokenizer

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]
GREEDY = dict(model="tiny", temperature=0.0, extra_body={"ignore_eos": True, "return_token_ids": True})


def test_chat_prompt_is_the_models_template_with_a_generation_prompt(client, tied_model):
    choice = client.chat.completions.create(messages=MESSAGES, max_completion_tokens=6, **GREEDY).choices[0]
    tokenizer = AutoTokenizer.from_pretrained(tied_model)
    expected = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert expected.endswith("<|im_start|>assistant\n")
    assert choice.prompt_token_ids == tokenizer.encode(expected, add_special_tokens=False)
    assert choice.message.role == "assistant" and len(choice.token_ids) == 6
    # the same tokens as a completion of the rendered prompt
    completion = client.completions.create(prompt=choice.prompt_token_ids, max_tokens=6, **GREEDY).choices[0]
    assert completion.token_ids == choice.token_ids and completion.text == choice.message.content


def test_max_tokens_limits_chat_as_max_completion_tokens_does(client):
    for limit in ({"max_tokens": 3}, {"max_completion_tokens": 3}):
        response = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0.0,
                                                  extra_body={"ignore_eos": True}, **limit)
        assert response.usage.completion_tokens == 3 and response.choices[0].finish_reason == "length"


def test_async_chat_stream_starts_with_the_role_and_equals_the_whole_answer(async_client):
    async def run():
        kwargs = dict(model="tiny", messages=MESSAGES, max_completion_tokens=10, temperature=0.0, n=2,
                      extra_body={"ignore_eos": True})
        whole = await async_client.chat.completions.create(**kwargs)
        stream = await async_client.chat.completions.create(stream=True, **kwargs)
        return whole, [chunk async for chunk in stream]

    whole, chunks = asyncio.run(run())
    for index in range(2):
        deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices[0].index == index]
        assert deltas[0].role == "assistant"
        assert all(delta.role is None for delta in deltas[1:])
        assert "".join(delta.content or "" for delta in deltas) == whole.choices[index].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert {chunk.id for chunk in chunks} == {chunks[0].id} and chunks[0].object == "chat.completion.chunk"


def test_chat_logprobs_list_the_top_alternatives(client):
    choice = client.chat.completions.create(messages=MESSAGES, max_completion_tokens=5, logprobs=True,
                                            top_logprobs=3, **GREEDY).choices[0]
    content = choice.logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy: the top one
        assert entry.bytes == list(entry.token.encode())


def test_chat_without_logprobs_has_none(client):
    assert client.chat.completions.create(messages=MESSAGES, max_completion_tokens=2, **GREEDY).choices[0].logprobs \
        is None
