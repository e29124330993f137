"""Anthropic's Messages API through the real server and the real `anthropic` SDK: text, a forced tool call whose input
validates against its schema, a tool result fed back, a reasoning model's thinking as a thinking block, a stream
whose events build the message a whole call returns, a client that goes away aborting its request, and bad input
answered in Anthropic's error shape."""
import asyncio

import anthropic
import jsonschema
import pytest
from transformers import AutoTokenizer

from tests.entrypoints.conftest import BLOCK_SIZE, Server, running_server

WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                             "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                            "required": ["city", "days"]}}
# a forced call to it writes at least 300 tokens (one a byte): long enough to walk away from
ESSAY = {"name": "essay", "input_schema": {"type": "object", "required": ["text"],
                                           "properties": {"text": {"type": "string", "minLength": 300}}}}
# the SDK leaves temperature, top_k and top_p out of its signature now: they go in the body as they are
GREEDY = {"temperature": 0}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
API_KEY = "sk-anthropic"
# ChatML that renders tool calls, tool results and past thinking, and opens the thinking when it is enabled
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m['content'] or '' }}"
            "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
            "{% if m.tool_call_id %} ({{ m.tool_call_id }}){% endif %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking %}<think>\n{% endif %}"
            "{% endif %}")


@pytest.fixture
def client(server):
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60.0) as client:
        yield client


@pytest.fixture(scope="module")
def reasoning_server(thinking_model):
    yield from running_server(thinking_model, "--max-model-len", "512", "--num-kvcache-blocks", "96",
                              "--reasoning-parser", "qwen3", "--chat-template", TEMPLATE, "--api-key", API_KEY)


@pytest.fixture(scope="module")
def reasoning_client(reasoning_server):
    # the SDK sends its key as x-api-key
    with anthropic.Anthropic(base_url=reasoning_server.url, api_key=API_KEY, max_retries=0, timeout=60.0) as client:
        yield client


def without_ids(message) -> dict:
    body = message.model_dump(exclude_none=True)
    body.pop("id")
    for block in body["content"]:
        block.pop("id", None)
    return body


def streamed(client, **kwargs):
    """(the event types, the message the SDK assembles from them) of one streamed call."""
    with client.messages.stream(**kwargs) as stream:
        types = [event.type for event in stream if event.type not in ("text", "thinking", "input_json",
                                                                       "signature")]
        return types, stream.get_final_message()


def test_a_plain_message_comes_back_as_text(client):
    message = client.messages.create(model="tiny", max_tokens=8, extra_body=GREEDY, messages=ASK,
                                     system="Be brief.")
    assert message.type == "message" and message.role == "assistant" and message.model == "tiny"
    assert all(block.type == "text" for block in message.content)
    assert message.stop_reason in ("end_turn", "max_tokens") and message.stop_sequence is None
    assert 1 <= message.usage.output_tokens <= 8
    count = client.messages.count_tokens(model="tiny", messages=ASK, system="Be brief.")
    assert message.usage.input_tokens == count.input_tokens > len("What is the weather in Paris?")


def test_a_stream_builds_the_message_a_whole_call_returns(client):
    for kwargs in (dict(max_tokens=12), dict(max_tokens=40, tools=[WEATHER],
                                             tool_choice={"type": "tool", "name": "get_weather"})):
        kwargs = dict(model="tiny", extra_body=GREEDY, messages=ASK, **kwargs)
        whole = client.messages.create(**kwargs)
        types, final = streamed(client, **kwargs)
        assert without_ids(final) == without_ids(whole)
        assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
        assert types.count("content_block_start") == types.count("content_block_stop") == len(whole.content)


def test_a_stop_sequence_ends_the_message_and_is_named(client):
    text = client.messages.create(model="tiny", max_tokens=12, extra_body=GREEDY, messages=ASK).content[0].text
    stop = text[3:5]
    message = client.messages.create(model="tiny", max_tokens=12, extra_body=GREEDY, messages=ASK,
                                     stop_sequences=[stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == text[:text.index(stop)]


@pytest.mark.parametrize("tool_choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}])
def test_a_forced_tool_call_validates_against_its_input_schema(client, tool_choice):
    message = client.messages.create(model="tiny", max_tokens=150, extra_body={"temperature": 1.0}, messages=ASK,
                                     tools=[WEATHER],
                                     tool_choice={**tool_choice, "disable_parallel_tool_use": True})
    assert message.stop_reason == "tool_use"
    [call] = message.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id
    jsonschema.validate(call.input, WEATHER["input_schema"])


def test_a_tool_result_fed_back_is_rendered_and_answered(reasoning_client, thinking_model):
    call = reasoning_client.messages.create(model="tiny", max_tokens=60, extra_body=GREEDY, messages=ASK,
                                            tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
    call = call.content[0]
    conversation = [*ASK, {"role": "assistant", "content": [call]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                  "content": [{"type": "text", "text": "sunny"}]},
                                                 {"type": "text", "text": "And tomorrow?"}]}]
    answer = reasoning_client.messages.create(model="tiny", max_tokens=4, extra_body=GREEDY, messages=conversation,
                                              tools=[WEATHER], tool_choice={"type": "none"})
    assert answer.content == [] or answer.content[0].type == "text"
    # the prompt is chat completions' own: the call as the assistant's tool_calls, the result as a tool message
    chat = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.input}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}, {"role": "user", "content": "And tomorrow?"}]
    tokenizer = AutoTokenizer.from_pretrained(thinking_model)
    expected = tokenizer.apply_chat_template(chat, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=False,
                                             enable_thinking=False)
    assert answer.usage.input_tokens == len(tokenizer.encode(expected, add_special_tokens=False))


def test_thinking_comes_apart_as_a_thinking_block(reasoning_client):
    kwargs = dict(model="tiny", max_tokens=40, extra_body=GREEDY, messages=ASK,
                  thinking={"type": "enabled", "budget_tokens": 6})
    whole = reasoning_client.messages.create(**kwargs)
    thinking = whole.content[0]
    assert thinking.type == "thinking" and thinking.thinking and "<think>" not in thinking.thinking
    # the template opened the thinking and the tiny model never closes it: it is cut at its budget
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 6 and len(whole.content) == 1
    _, final = streamed(reasoning_client, **kwargs)
    assert without_ids(final) == without_ids(whole)
    # fed back, the thinking goes to the template as the assistant's reasoning_content
    conversation = [*ASK, {"role": "assistant", "content": [thinking, {"type": "text", "text": "Rain."}]}, *ASK]
    count = reasoning_client.messages.count_tokens(model="tiny", messages=conversation).input_tokens
    without = reasoning_client.messages.count_tokens(model="tiny", messages=[*ASK, {"role": "assistant",
                                                     "content": "Rain."}, *ASK]).input_tokens
    assert count > without


def test_without_thinking_enabled_the_template_does_not_open_it(reasoning_client):
    whole = reasoning_client.messages.create(model="tiny", max_tokens=6, extra_body=GREEDY, messages=ASK)
    assert [block.type for block in whole.content] in ([], ["text"])
    # adaptive thinking: the template opens it (its "<think>\n"), and the model may close it at once
    counts = [reasoning_client.messages.count_tokens(model="tiny", messages=ASK, **thinking).input_tokens
              for thinking in ({}, {"thinking": {"type": "disabled"}}, {"thinking": {"type": "adaptive"}})]
    assert counts[0] == counts[1] == counts[2] - 2


def test_thinking_needs_a_reasoning_parser(client):
    with pytest.raises(anthropic.BadRequestError, match="--reasoning-parser"):
        client.messages.create(model="tiny", max_tokens=40, messages=ASK, thinking={"type": "enabled",
                                                                                    "budget_tokens": 8})


@pytest.mark.parametrize("body, names", [
    ({"messages": ASK}, "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, "image"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "hi"}}]}]}, "document"),
    ({"max_tokens": 4, "messages": ASK, "top_logprobs": 2}, "top_logprobs: unknown field"),
    ({"max_tokens": 4, "messages": ASK, "temperature": 1.5}, "temperature"),
    ({"max_tokens": 4, "messages": ASK, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    ({"max_tokens": 4, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 8}}, "budget_tokens"),
])
def test_bad_input_is_a_400_in_anthropics_shape_naming_it(server, body, names):
    status, answer = server.request("POST", "/v1/messages", {"model": "tiny", **body})
    assert status == 400
    assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
    assert names in answer["error"]["message"]


def test_the_sdk_reads_the_errors(server, client):
    with pytest.raises(anthropic.BadRequestError) as error:
        client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://example.com/a.png"}}]}])
    assert error.value.body["error"]["type"] == "invalid_request_error" and "image" in error.value.message
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="another", max_tokens=4, messages=ASK)


def test_the_api_key_is_checked_as_anthropic_sends_it(reasoning_server):
    with anthropic.Anthropic(base_url=reasoning_server.url, api_key="wrong", max_retries=0) as client:
        with pytest.raises(anthropic.AuthenticationError) as error:
            client.messages.create(model="tiny", max_tokens=2, messages=ASK)
    assert error.value.body["error"]["type"] == "authentication_error"


def read(server, name: str, **labels) -> float:
    return server.metric(f"tpengine:{name}", model_name="tiny", **labels)


def test_messages_count_in_the_metrics(server, client):
    before = [read(server, name) for name in ("prompt_tokens_total", "generation_tokens_total")]
    message = client.messages.create(model="tiny", max_tokens=5, extra_body=GREEDY, messages=ASK)
    after = [read(server, name) for name in ("prompt_tokens_total", "generation_tokens_total")]
    assert [b - a for a, b in zip(before, after)] == [message.usage.input_tokens, message.usage.output_tokens]


def test_a_client_that_goes_away_aborts_its_request(server, client):
    kwargs = dict(model="tiny", max_tokens=400, extra_body=GREEDY, messages=ASK, tools=[ESSAY],
                  tool_choice={"type": "tool", "name": "essay"})
    aborted = read(server, "request_success_total", finished_reason="abort")
    with client.messages.stream(**kwargs) as stream:
        for _, _event in zip(range(5), stream):
            pass
        assert read(server, "num_requests_running") == 1
    server.wait_for_metric("tpengine:num_requests_running", 0.0, model_name="tiny")

    async def start_then_cancel():
        async with anthropic.AsyncAnthropic(base_url=server.url, api_key="unused", max_retries=0) as async_client:
            call = asyncio.ensure_future(async_client.messages.create(**kwargs))
            while read(server, "num_requests_running") == 0:
                await asyncio.sleep(0.02)
            call.cancel()

    asyncio.run(start_then_cancel())
    server.wait_for_metric("tpengine:num_requests_running", 0.0, model_name="tiny")
    assert read(server, "request_success_total", finished_reason="abort") - aborted == 2


def test_a_tensor_parallel_server_answers_the_same_way(tied_model):
    server = Server("--model", tied_model, "--tp", "2", "--block-size", str(BLOCK_SIZE), "--num-kvcache-blocks", "64",
                    "--max-model-len", "256")
    try:
        with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60.0) as client:
            kwargs = dict(model="tiny", max_tokens=60, extra_body=GREEDY, messages=ASK, tools=[WEATHER],
                          tool_choice={"type": "tool", "name": "get_weather"})
            whole = client.messages.create(**kwargs)
            jsonschema.validate(whole.content[0].input, WEATHER["input_schema"])
            assert without_ids(streamed(client, **kwargs)[1]) == without_ids(whole)
        assert server.stop() == 0
    finally:
        server.kill_leftovers()
