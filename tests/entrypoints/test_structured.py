"""Structured outputs, tool calls and reasoning through the real server and the openai client: every output
matches its schema, regex or choice, streamed or not; "required" and named tool calls validate against the
tools' schemas; "auto" answers in hermes format parse into tool_calls; a reasoning model's thinking comes
apart as reasoning_content."""
import json
import re

import jsonschema
import openai
import pytest

from tests.entrypoints.conftest import running_server
from tests.structured.test_structured_outputs import SCHEMAS

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 8},
                                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                          "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"enum": ["UTC", "CET", "JST"]}}, "required": ["tz"]}}},
    {"type": "function", "function": {"name": "no_arguments"}},
]
SCHEMA_OF = {tool["function"]["name"]: tool["function"].get("parameters") or {"type": "object"} for tool in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_CALL = r'<tool_call>\{"name": "get_time", "arguments": \{"tz": "(UTC|CET|JST)"\}\}</tool_call>'


@pytest.fixture(scope="module")
def tool_server(tied_model):
    yield from running_server(tied_model, "--enable-auto-tool-choice", "--tool-call-parser", "hermes")


@pytest.fixture
def tool_client(tool_server):
    with openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def assert_valid_calls(calls, expected_names=None) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        name = call.function.name
        assert name in SCHEMA_OF and (expected_names is None or name in expected_names)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[name])


def streamed_calls(stream) -> tuple[str, list[dict], str | None]:
    """(content, calls as OpenAI's streaming client would assemble them, finish_reason) of a chat stream."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or ():
                entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = entry["id"] or call.id
                if call.function is not None:
                    entry["name"] += call.function.name or ""
                    entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True])
def test_json_schemas_are_followed_through_response_format_and_structured_outputs(tool_client, stream):
    for i, schema in enumerate(SCHEMAS * 2):
        if i % 2:
            extra = dict(response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}})
        else:
            extra = dict(extra_body={"structured_outputs": {"json": schema, "disable_any_whitespace": True}})
        kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=300, temperature=1.0, seed=i, **extra)
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in tool_client.chat.completions.create(
                stream=True, **kwargs) if c.choices)
        else:
            text = tool_client.chat.completions.create(**kwargs).choices[0].message.content
        jsonschema.validate(json.loads(text), schema)


def test_regex_and_choice_on_completions_and_chat(tool_client):
    for seed in range(6):
        text = tool_client.completions.create(model="tiny", prompt="code:", max_tokens=40, seed=seed, temperature=1.0,
                                              extra_body={"structured_outputs": {"regex": r"[A-Z]{2}-\d{3}"}}
                                              ).choices[0].text
        assert re.fullmatch(r"[A-Z]{2}-\d{3}", text)
        answer = tool_client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, seed=seed,
                                                     extra_body={"structured_outputs": {"choice": ["sun", "rain"]}})
        assert answer.choices[0].message.content in ("sun", "rain")


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_calls_validate_against_the_tools_schemas(tool_client, stream):
    for seed in range(8):
        kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=300,
                      temperature=1.0, seed=seed)
        if stream:
            _, calls, finish = streamed_calls(tool_client.chat.completions.create(stream=True, **kwargs))
            assert finish == "tool_calls" and calls
            for call in calls:
                assert call["id"] and call["name"] in SCHEMA_OF
                jsonschema.validate(json.loads(call["arguments"]), SCHEMA_OF[call["name"]])
        else:
            choice = tool_client.chat.completions.create(**kwargs).choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            assert_valid_calls(choice.message.tool_calls)
    one = tool_client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                              parallel_tool_calls=False, max_tokens=300, seed=1).choices[0]
    assert len(one.message.tool_calls) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_is_called_with_valid_arguments(tool_client, stream):
    for seed, name in enumerate(["get_weather", "get_time", "no_arguments"] * 2):
        kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=200, seed=seed, temperature=1.0,
                      tool_choice={"type": "function", "function": {"name": name}})
        if stream:
            _, calls, finish = streamed_calls(tool_client.chat.completions.create(stream=True, **kwargs))
            assert finish == "tool_calls" and [c["name"] for c in calls] == [name]
            jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMA_OF[name])
        else:
            choice = tool_client.chat.completions.create(**kwargs).choices[0]
            assert choice.finish_reason == "tool_calls"
            assert_valid_calls(choice.message.tool_calls, {name})


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_the_calls_the_model_wrote_in_hermes_format(tool_client, stream):
    # a random model never writes a call by itself: a regex makes it write one, as a tuned model would
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=100, seed=2,
                  extra_body={"structured_outputs": {"regex": r"Checking\. " + HERMES_CALL}})
    if stream:
        content, calls, finish = streamed_calls(tool_client.chat.completions.create(stream=True, **kwargs))
        assert [c["name"] for c in calls] == ["get_time"] and json.loads(calls[0]["arguments"])["tz"] in (
            "UTC", "CET", "JST")
    else:
        choice = tool_client.chat.completions.create(**kwargs).choices[0]
        content, finish = choice.message.content, choice.finish_reason
        assert_valid_calls(choice.message.tool_calls, {"get_time"})
    assert content.strip() == "Checking." and finish == "tool_calls"
    plain = tool_client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=8, seed=3)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "length"


def test_tool_results_and_earlier_calls_in_the_history_go_through_the_template(tool_client):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    answer = tool_client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=4)
    assert answer.choices[0].finish_reason == "length"


@pytest.mark.parametrize("body, param, message", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot also"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "wrong"}}}],
      "tool_choice": "required"}, "tools", "wrong"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "nope"),
    ({"structured_outputs": {"regex": "(", "json_object": True}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs",
     "not both"),
    ({"structured_outputs": {"bogus": 1}}, "structured_outputs", "bogus"),
])
def test_bad_tools_and_grammars_get_400_naming_the_field(tool_server, body, param, message):
    status, answer = tool_server.request("POST", "/v1/chat/completions",
                                         {"model": "tiny", "messages": MESSAGES, **body})
    assert status == 400, answer
    assert answer["error"]["param"] == param and message in answer["error"]["message"], answer


@pytest.fixture(scope="module")
def reasoning_server(thinking_model):
    # a later flag overrides the suite's value
    yield from running_server(thinking_model, "--max-model-len", "256", "--num-kvcache-blocks", "64",
                              "--reasoning-parser", "deepseek_r1")


@pytest.mark.parametrize("stream", [False, True])
def test_the_thinking_comes_apart_and_the_grammar_constrains_only_the_answer(reasoning_server, thinking_model,
                                                                          stream):
    from transformers import AutoTokenizer
    think_end = AutoTokenizer.from_pretrained(thinking_model).convert_tokens_to_ids("</think>")
    with openai.OpenAI(base_url=f"{reasoning_server.url}/v1", api_key="unused", max_retries=0) as client:
        # free thinking, ended by the bias on </think> after a few tokens' worth of chance; then the answer
        kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=60, seed=5, temperature=1.0,
                      logit_bias={str(think_end): 100}, extra_body={"structured_outputs": {"choice": ["sun", "rain"]}})
        if stream:
            reasoning = content = ""
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                delta = chunk.choices[0].delta if chunk.choices else None
                reasoning += getattr(delta, "reasoning_content", None) or "" if delta else ""
                content += delta.content or "" if delta else ""
        else:
            message = client.chat.completions.create(**kwargs).choices[0].message
            reasoning, content = message.reasoning_content, message.content
        assert reasoning == "" and content in ("sun", "rain")
        # without the bias the thinking runs free to max_tokens: all of it is reasoning, none is answer
        message = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, seed=6,
                                                 logit_bias={str(think_end): -100}).choices[0].message
        assert message.reasoning_content and not message.content
    with openai.OpenAI(base_url=f"{reasoning_server.url}/v1", api_key="unused", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
            client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=4)
