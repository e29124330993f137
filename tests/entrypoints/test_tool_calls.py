"""The tool-call readers and the reasoning splitter on hand-written text: whole answers, and the same answers
streamed in every split, give the same content, calls and reasoning."""
import json

import pytest

from tpengine.entrypoints.reasoning import ReasoningSplitter
from tpengine.entrypoints.tool_calls import (HermesCalls, Llama3JsonCalls, NamedCall, RequiredCalls, parse_llama3_json,
                                             required_schema)
from tpengine.thinking import thinking_open_after

NAMES = {"get_weather", "get_time"}
HERMES = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
          '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')


def read(reader, text: str, step: int = 0) -> tuple[str, list[tuple[str, str]], list[tuple[str, str]]]:
    """(content, calls, calls as a streaming client assembles the deltas) of text fed in pieces of step characters
    (0: whole)."""
    pieces = [text[i:i + step] for i in range(0, len(text), step)] if step else [text]
    content, assembled = "", {}
    for i, piece in enumerate(pieces + [""]):
        new_content, entries = reader.feed(piece, final=i == len(pieces))
        content += new_content
        for entry in entries:
            call = assembled.setdefault(entry["index"], ["", ""])
            call[0] += entry["function"].get("name", "")
            call[1] += entry["function"]["arguments"]
    assert content == reader.content
    calls = [(call.name, call.arguments) for call in reader.calls]
    return content, calls, [tuple(assembled[i]) for i in sorted(assembled)]


def test_hermes_calls_and_the_content_before_them():
    reader = HermesCalls(NAMES, parallel=True)
    content, calls, _ = read(reader, HERMES)
    assert content == "Let me look."
    assert calls == [("get_weather", '{"city": "Paris", "days": 2}'), ("get_time", "{}")]
    assert len({c.id for c in reader.calls}) == 2 and all(c.id.startswith("chatcmpl-tool-") for c in reader.calls)
    assert read(HermesCalls(NAMES, parallel=False), HERMES)[1] == calls[:1]


@pytest.mark.parametrize("text", [
    "no calls at all",
    'A <tool_call>{"name": "unknown_tool", "arguments": {}}</tool_call>',   # not one of the request's tools
    '<tool_call>{"name": "get_time", "arguments": </tool_call>',          # not JSON
    "ends with whitespace  \n",
])
def test_hermes_text_that_is_not_calls_stays_content(text):
    assert read(HermesCalls(NAMES, parallel=True), text)[:2] == (text, [])


def test_hermes_text_after_the_calls_is_content_too():
    text = 'Sure. <tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>\n and then some text'
    assert read(HermesCalls(NAMES, parallel=True), text)[:2] == ("Sure.and then some text",
                                                                 [("get_time", '{"tz": "UTC"}')])


def test_llama3_json_calls():
    content, calls = parse_llama3_json('<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}; '
                                       '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 1}}', NAMES)
    assert content == "" and [c.name for c in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[0].arguments) == {"tz": "UTC"}
    assert parse_llama3_json("The weather {is} fine", NAMES) == ("The weather {is} fine", [])


def test_required_calls_are_read_as_written_and_the_schema_lists_every_tool():
    tools = [{"type": "function", "function": {"name": n}} for n in sorted(NAMES)]
    schema = required_schema(tools, parallel=False)
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    whole = '[{"name":"get_time","parameters":{"tz":"CET"}},{"name":"get_weather","parameters":{"city":"a]}"}}]'
    assert read(RequiredCalls(), whole)[:2] == ("", [("get_time", '{"tz":"CET"}'),
                                                     ("get_weather", '{"city":"a]}"}')])
    # cut short by max_tokens: the calls begun, the last one's arguments as far as they were written
    assert read(RequiredCalls(), '[{"name":"get_time","parameters":{"tz":"C')[:2] == ("", [("get_time", '{"tz":"C')])
    assert read(RequiredCalls(), '[{"name":"get_ti')[:2] == ("", [])


def test_a_named_call_goes_out_with_its_first_argument_text():
    assert read(NamedCall("get_time"), '{"tz":"U')[:2] == ("", [("get_time", '{"tz":"U')])
    assert read(NamedCall("get_time"), "")[:2] == ("", [])  # nothing written (max_tokens spent thinking): no call


@pytest.mark.parametrize("reader, text", [
    (lambda: HermesCalls(NAMES, True), HERMES),
    (lambda: HermesCalls(NAMES, True), "just words < and <tool maybe"),
    (lambda: HermesCalls(NAMES, True), 'Sure. <tool_call>{"name": "get_time", "arguments": {"tz": "U'),
    (lambda: HermesCalls(NAMES, True), 'A <tool_call>{"name": "nope", "arguments": {}}</tool_call> B'),
    (lambda: Llama3JsonCalls(NAMES, True), '{"name": "get_time", "parameters": {}}'),
    (lambda: Llama3JsonCalls(NAMES, True), "words first {x}"),
    (lambda: RequiredCalls(), '[{"name":"get_time","parameters":{"tz":"C\\"}"}},{"name":"get_weather","param'),
    (lambda: NamedCall("get_time"), '{"tz":"UTC"}'),
])
@pytest.mark.parametrize("step", [1, 2, 5])
def test_a_streamed_answer_gives_what_the_whole_answer_gives(reader, text, step):
    whole = read(reader(), text)
    streamed = read(reader(), text, step)
    assert streamed == whole and streamed[1] == streamed[2]  # the deltas add up to the calls


@pytest.mark.parametrize("step", [1, 3])
def test_hermes_arguments_stream_as_they_are_written(step):
    reader, pieces = HermesCalls(NAMES, parallel=True), []
    for i in range(0, len(HERMES), step):
        pieces.append(reader.feed(HERMES[i:i + step])[1])
    argument_deltas = [e["function"]["arguments"] for entries in pieces for e in entries if e["index"] == 0]
    assert len([d for d in argument_deltas if d]) > 5


@pytest.mark.parametrize("thinking_open, text, expected", [
    (False, "<think>\nsome thought</think>\n\nThe answer", ("\nsome thought", "The answer")),
    (False, "An answer without thinking", (None, "An answer without thinking")),
    (False, "</think>{}", (None, "</think>{}")),  # the reply did not open its thinking: no tag closes it
    (True, "thinking first</think>then the answer", ("thinking first", "then the answer")),
    (True, "<think>opened again</think>x", ("opened again", "x")),
    (True, "never finished thinking", ("never finished thinking", "")),
])
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_reasoning_comes_apart_whole_and_streamed(thinking_open, text, expected, step):
    splitter, reasoning, answer = ReasoningSplitter(thinking_open), "", ""
    for i in range(0, len(text), step):
        r, a = splitter.feed(text[i:i + step])
        reasoning, answer = reasoning + r, answer + a
    r, a = splitter.feed("", final=True)
    assert (reasoning + r if splitter.thinking else None, answer + a) == expected


def test_the_prompts_last_reasoning_tag_says_whether_the_thinking_is_open():
    start, end = 7, 8
    assert thinking_open_after([1, 2, start, 3], start, end)          # a template opened it
    assert not thinking_open_after([1, start, 3, end, 4], start, end)  # thinking turned off, or an earlier turn's
    assert not thinking_open_after([1, 2, 3], start, end)             # no tag: the reply decides
    assert thinking_open_after([start, end, 5, start], start, end)
