"""The tool-call parsers and the reasoning splitter on hand-written text: whole answers, and the same answers
streamed in every split, give the same content, calls and reasoning."""
import json

import pytest

from tpengine.entrypoints.reasoning import ReasoningSplitter, split_reasoning
from tpengine.entrypoints.tool_calls import (StreamedCalls, parse_hermes, parse_llama3_json, parse_required,
                                             required_schema)

NAMES = {"get_weather", "get_time"}
HERMES = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
          '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')


def test_hermes_calls_and_the_content_before_them():
    content, calls = parse_hermes(HERMES, NAMES)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "days": 2}),
                                                                  ("get_time", {})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("chatcmpl-tool-") for c in calls)


@pytest.mark.parametrize("text", [
    "no calls at all",
    '<tool_call>{"name": "unknown_tool", "arguments": {}}</tool_call>',   # not one of the request's tools
    '<tool_call>{"name": "get_time", "arguments": </tool_call>',         # not JSON
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> and then some text',
])
def test_hermes_text_that_is_not_calls_stays_content(text):
    assert parse_hermes(text, NAMES) == (text, [])


def test_llama3_json_calls():
    content, calls = parse_llama3_json('<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}; '
                                       '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 1}}', NAMES)
    assert content == "" and [c.name for c in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[0].arguments) == {"tz": "UTC"}
    assert parse_llama3_json("The weather {is} fine", NAMES) == ("The weather {is} fine", [])


def test_required_answers_parse_and_the_schema_lists_every_tool():
    tools = [{"type": "function", "function": {"name": n}} for n in sorted(NAMES)]
    schema = required_schema(tools, parallel=False)
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    calls = parse_required('[{"name": "get_time", "parameters": {"tz": "CET"}}]')
    assert [(c.name, c.arguments) for c in calls] == [("get_time", '{"tz": "CET"}')]
    assert parse_required('[{"name": "get_time"') is None  # cut short by max_tokens


@pytest.mark.parametrize("parser, text", [
    ("hermes", HERMES), ("hermes", "just words < and <tool maybe"),
    ("llama3_json", '{"name": "get_time", "parameters": {}}'), ("llama3_json", "words first {x}"),
])
@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_a_streamed_auto_answer_gives_what_the_whole_answer_gives(parser, text, step):
    whole = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}[parser](text, NAMES)
    streamed = StreamedCalls(parser, NAMES)
    content = "".join(streamed.feed(text[i:i + step]) for i in range(0, len(text), step))
    rest, calls = streamed.finish()
    # streamed content cannot take back the whitespace it sent before a call; the whole answer's is trimmed
    assert (content + rest).rstrip() == (whole[0] if whole[1] else text).rstrip()
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole[1]]


@pytest.mark.parametrize("parser, text, expected", [
    ("qwen3", "<think>\nsome thought</think>\n\nThe answer", ("\nsome thought", "The answer")),
    ("qwen3", "An answer without thinking", (None, "An answer without thinking")),
    ("deepseek_r1", "thinking first</think>then the answer", ("thinking first", "then the answer")),
    ("deepseek_r1", "<think>opened again</think>x", ("opened again", "x")),
    ("deepseek_r1", "never finished thinking", ("never finished thinking", "")),
])
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_reasoning_comes_apart_whole_and_streamed(parser, text, expected, step):
    assert split_reasoning(parser, text) == expected
    splitter, reasoning, answer = ReasoningSplitter(parser), "", ""
    for i in range(0, len(text), step):
        r, a = splitter.feed(text[i:i + step])
        reasoning, answer = reasoning + r, answer + a
    r, a = splitter.feed("", final=True)
    assert (reasoning + r or (None if expected[0] is None else ""), answer + a) == expected
