"""Structured outputs, tool calls and reasoning through the real server and the openai client: every output
matches its schema, regex or choice, streamed or not; "required" and named tool calls validate against the
tools' schemas; "auto" answers in hermes format parse into tool_calls; calls stream as they are written, and one cut
by max_tokens comes back as the call it began (a reasoning model's constraints: test_reasoning_constraints.py)."""
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


def test_required_and_hermes_calls_stream_as_they_are_written_and_agree_with_whole_replies(tool_client):
    for extra in (dict(tool_choice="required", seed=1),
                  dict(seed=2, extra_body={"structured_outputs": {"regex": r"Checking\. " + HERMES_CALL}})):
        kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=200, temperature=1.0, **extra)
        whole = tool_client.chat.completions.create(**kwargs).choices[0]
        chunks = list(tool_client.chat.completions.create(stream=True, **kwargs))
        argument_deltas = [call.function.arguments for chunk in chunks
                           for call in chunk.choices[0].delta.tool_calls or () if call.function.arguments]
        assert len(argument_deltas) > 3  # not one delta with the whole call at the end
        content, calls, finish = streamed_calls(chunks)
        assert content == (whole.message.content or "") and finish == whole.finish_reason == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in calls] == [(c.function.name, c.function.arguments)
                                                                for c in whole.message.tool_calls]
    assert whole.message.content == "Checking."  # the whitespace before a call is not content, streamed or not


def test_a_tool_call_cut_by_max_tokens_comes_back_as_the_call_it_began(tool_client):
    # "required" and a named function alike: finish_reason "length", the call with the arguments written so far
    # (one byte a token: '[{"name":"get_weather","parameters":' is 36)
    for seed, (tool_choice, max_tokens) in enumerate([("required", 40), (
            {"type": "function", "function": {"name": "get_weather"}}, 4)]):
        kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS[:1], tool_choice=tool_choice, max_tokens=max_tokens,
                      temperature=1.0, seed=seed)
        whole = tool_client.chat.completions.create(**kwargs).choices[0]
        assert whole.finish_reason == "length" and whole.message.content is None
        [call] = whole.message.tool_calls
        assert call.function.name == "get_weather" and len(call.function.arguments) == 4
        with pytest.raises(ValueError):
            json.loads(call.function.arguments)
        content, calls, finish = streamed_calls(tool_client.chat.completions.create(stream=True, **kwargs))
        assert (content, finish) == ("", "length")
        assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]


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
