"""/v1/completions through the official openai client: parity with LLM.generate, streaming, prompt forms."""
import asyncio
import functools

import pytest

from tests.conftest import hf_greedy
from tests.entrypoints.conftest import BLOCK_SIZE
from tpengine import LLM, SamplingParams

PROMPTS = ["Hello, my name is", "Tensor parallelism splits", "a"]
GREEDY = dict(model="tiny", temperature=0.0, extra_body={"ignore_eos": True, "return_token_ids": True})


@functools.lru_cache(maxsize=None)
def offline_greedy(model: str, prompts: tuple, max_tokens: int) -> list:
    with LLM(model, kvcache_block_size=BLOCK_SIZE, num_kvcache_blocks=64, max_model_len=512) as llm:
        return llm.generate(list(prompts), SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                            use_tqdm=False)


def assert_greedy_equals_offline(client, model: str) -> None:
    response = client.completions.create(prompt=PROMPTS, max_tokens=12, **GREEDY)
    choices = sorted(response.choices, key=lambda choice: choice.index)
    offline = offline_greedy(model, tuple(PROMPTS), 12)
    assert [choice.token_ids for choice in choices] == [out.outputs[0].token_ids for out in offline]
    assert [choice.text for choice in choices] == [out.outputs[0].text for out in offline]
    assert [choice.prompt_token_ids for choice in choices] == [out.prompt_token_ids for out in offline]
    assert [choice.token_ids for choice in choices] == hf_greedy(model, [out.prompt_token_ids for out in offline], 12)
    assert response.usage.completion_tokens == 12 * len(PROMPTS)


def test_greedy_completions_equal_offline_generate(client, tied_model):
    assert_greedy_equals_offline(client, tied_model)


def test_streamed_text_equals_non_streamed(client):
    for extra in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 7}):
        kwargs = dict(model="tiny", prompt="Once upon a time", max_tokens=24, extra_body={"ignore_eos": True}, **extra)
        whole = client.completions.create(**kwargs).choices[0]
        chunks = list(client.completions.create(stream=True, **kwargs))
        assert "".join(chunk.choices[0].text for chunk in chunks) == whole.text
        assert chunks[-1].choices[0].finish_reason == whole.finish_reason == "length"
        assert all(chunk.choices[0].finish_reason is None for chunk in chunks[:-1])


def test_every_prompt_form_gives_its_choices_in_order(client, server):
    ids = client.completions.create(prompt="abc", max_tokens=1, **GREEDY).choices[0].prompt_token_ids
    for prompt, num_prompts in (("abc", 1), (["abc", "xyz"], 2), (ids, 1), ([ids, ids[:2]], 2)):
        response = client.completions.create(prompt=prompt, max_tokens=3, n=2, **GREEDY)
        assert [choice.index for choice in response.choices] == list(range(2 * num_prompts))
        assert response.choices[0].prompt_token_ids == ids
        assert response.usage.completion_tokens == 3 * 2 * num_prompts


def test_stream_include_usage_ends_with_a_usage_chunk(client):
    chunks = list(client.completions.create(model="tiny", prompt="usage", max_tokens=5, temperature=0.0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert all(chunk.usage is None for chunk in chunks[:-1])
    assert chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (5, 5)
    assert chunks[-1].usage.total_tokens == 10


def test_stop_string_ends_the_completion_and_is_cut(client):
    text = client.completions.create(prompt="stop here", max_tokens=16, **GREEDY).choices[0].text
    stop = text[5:7]
    first = text.index(stop)
    for include in (False, True):
        choice = client.completions.create(prompt="stop here", max_tokens=16, stop=[stop], model="tiny",
                                           temperature=0.0, extra_body={"include_stop_str_in_output": include}).choices[0]
        assert choice.finish_reason == "stop" and choice.stop_reason == stop
        assert choice.text == text[:first + (len(stop) if include else 0)]


def test_seeded_samples_are_reproducible_and_distinct(client):
    kwargs = dict(model="tiny", prompt="seed", max_tokens=12, n=3, temperature=1.0, seed=123,
                  extra_body={"ignore_eos": True})
    first = [choice.text for choice in client.completions.create(**kwargs).choices]
    assert first == [choice.text for choice in client.completions.create(**kwargs).choices]
    assert len(set(first)) == 3


def test_echo_puts_the_prompt_before_the_completion(client):
    plain = client.completions.create(prompt="echo me", max_tokens=4, **GREEDY).choices[0]
    assert client.completions.create(prompt="echo me", max_tokens=4, echo=True, **GREEDY).choices[0].text == \
        "echo me" + plain.text
    by_ids = client.completions.create(prompt=[plain.prompt_token_ids, plain.prompt_token_ids], max_tokens=4,
                                       echo=True, stream=True, **GREEDY)
    texts = {}
    for chunk in by_ids:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {0: "echo me" + plain.text, 1: "echo me" + plain.text}


def test_logprobs_hold_the_greedy_token_on_top(client):
    choice = client.completions.create(prompt="logprobs", max_tokens=6, logprobs=3, **GREEDY).choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert 1 <= len(top) <= 4 and logprob <= 0.0  # 3 alternatives and the sampled token; equal texts merge
        assert max(top.values()) == pytest.approx(logprob)


def test_cached_prompt_tokens_are_reported(client):
    prompt = list(range(40, 40 + 2 * BLOCK_SIZE + 8))
    client.completions.create(prompt=prompt, max_tokens=1, **GREEDY)
    usage = client.completions.create(prompt=prompt, max_tokens=1, **GREEDY).usage
    # all of a repeated prompt comes from the prefix cache but its last token, which must run to sample
    assert usage.prompt_tokens_details.cached_tokens == len(prompt) - 1


def test_64_concurrent_streams_all_complete_with_their_lengths(async_client, server):
    lengths = [1 + (7 * i) % 24 for i in range(64)]

    async def one(i):
        stream = await async_client.completions.create(
            model="tiny", prompt=f"request number {i}", max_tokens=lengths[i], temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "return_token_ids": True})
        num_tokens, usage = 0, None
        async for chunk in stream:
            num_tokens += sum(len(choice.token_ids) for choice in chunk.choices)
            usage = chunk.usage or usage
        return num_tokens, usage.completion_tokens

    async def all_of_them():
        return await asyncio.gather(*(one(i) for i in range(64)))

    results = asyncio.run(all_of_them())
    assert [num_tokens for num_tokens, _ in results] == lengths
    assert [completion_tokens for _, completion_tokens in results] == lengths
    server.wait_for_metric("tpengine:num_requests_running", 0.0, model_name="tiny")


def test_render_gives_the_prompt_token_ids_a_request_would_run_and_generates_nothing(server, client):
    served_before = server.metric("tpengine:prompt_tokens_total", model_name="tiny")
    status, rendered = server.request("POST", "/v1/completions/render", {"model": "tiny", "prompt": PROMPTS[:2]})
    assert status == 200
    response = client.completions.create(prompt=PROMPTS[:2], max_tokens=1, **GREEDY)
    assert [r["token_ids"] for r in rendered] == [c.prompt_token_ids for c in response.choices]
    messages = [{"role": "user", "content": "hi"}]
    status, chat_rendered = server.request("POST", "/v1/chat/completions/render",
                                           {"model": "tiny", "messages": messages})
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1, temperature=0.0)
    assert status == 200 and len(chat_rendered["token_ids"]) == chat.usage.prompt_tokens
    # only the two real requests ran
    server.wait_for_metric("tpengine:prompt_tokens_total", served_before + sum(len(r["token_ids"]) for r in rendered)
                           + len(chat_rendered["token_ids"]), model_name="tiny")
    status, body = server.request("POST", "/v1/completions/render",
                                  {"model": "tiny", "prompt": "a", "no_stop_trim": True})
    assert status == 400 and "no_stop_trim" in body["error"]["message"]
