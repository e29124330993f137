"""Structured outputs through the real server under hostile input: a grammar that ends answers its request
(ignore_eos too), specs over the limits, with unenforced keywords or unsatisfiable are 400s in OpenAI's shape
naming the problem, and a model whose logits are not finite fails its requests with an error that says so."""
import json

import pytest

from tests.entrypoints.conftest import running_server
from tests.structured.test_grammar_hardening import nested_schema
from tpengine.structured.limits import MAX_SCHEMA_DEPTH


@pytest.mark.parametrize("constraint", [{"choice": ["a", "b"]}, {"regex": "[0-9]{2}"},
                                        {"json": {"type": "integer", "minimum": 0, "maximum": 9}}])
def test_a_constrained_completion_with_ignore_eos_is_answered(server, constraint):
    status, body = server.request("POST", "/v1/completions", {
        "prompt": "x", "max_tokens": 20, "ignore_eos": True, "structured_outputs": constraint}, timeout=30)
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("field, message", [
    ({"structured_outputs": {"json": nested_schema(400)}}, f"limit of {MAX_SCHEMA_DEPTH}"),
    ({"structured_outputs": {"json": {"type": "array", "uniqueItems": True}}}, "'uniqueItems'"),
    ({"structured_outputs": {"json": {"not": {"type": "string"}}}}, "'not'"),
    ({"structured_outputs": {"grammar": "root ::= root"}}, "matches no text"),
    ({"structured_outputs": {"choice": ["a", "b"]}, "min_tokens": 5}, "min_tokens=5 cannot be met"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"d": {"type": "string", "format": "idn-hostname"}}}}}}, "idn-hostname"),
])
def test_a_spec_the_server_cannot_hold_is_a_400_naming_the_problem(server, field, message):
    status, body = server.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": 8, **field}, timeout=30)
    assert status == 400, body
    assert message in body["error"]["message"] and body["error"]["type"] == "invalid_request_error"
    status, body = server.request("POST", "/v1/completions", {"prompt": "still", "max_tokens": 2})
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"


@pytest.fixture(scope="module")
def nan_server(nan_logits_model):
    yield from running_server(nan_logits_model)


def test_non_finite_logits_are_an_error_that_says_so(nan_server):
    status, body = nan_server.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": 4})
    assert status == 500 and "not finite" in body["error"]["message"], body
    status, text = nan_server.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": 4, "stream": True})
    assert status == 200
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert "not finite" in events[-1]["error"]["message"] and text.rstrip().endswith("data: [DONE]")


def test_tool_parameters_over_the_schema_limits_are_a_400_with_a_forced_call(server):
    tools = [{"type": "function", "function": {"name": "deep", "parameters": nested_schema(200)}}]
    status, body = server.request("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": "required",
        "max_tokens": 8}, timeout=30)
    assert status == 400 and f"limit of {MAX_SCHEMA_DEPTH}" in body["error"]["message"], body
