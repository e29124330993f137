"""Every error class gets its status in OpenAI's shape, and the server keeps serving after each."""
import json
import os
import shutil

import openai
import pytest

from tests.entrypoints.conftest import BLOCK_SIZE, Server

API_KEY = "sk-test-key"


def assert_openai_error(status: int, body, *message_parts: str) -> None:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in body["error"]["message"]
    for part in message_parts:
        assert part in body["error"]["message"]


@pytest.mark.parametrize("body, message", [
    ({"prompt": "a", "temperature": -1}, "temperature"),
    ({"prompt": "a", "top_p": 0}, "top_p"),
    ({"prompt": "a", "n": 0}, "n"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "stop": [""]}, "stop"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": ""}, "empty"),
    ({"prompt": []}, "empty"),
    ({"prompt": [1, 2, 10**6]}, "vocabulary"),
    ({"prompt": list(range(100)) * 6}, "max_model_len"),
    ({"prompt": "a", "logprobs": 21}, "logprobs"),
    ({"prompt": 7}, "prompt"),
    ({}, "prompt"),
])
def test_invalid_completion_requests_get_400(server, body, message):
    status, answer = server.request("POST", "/v1/completions", {"model": "tiny", **body})
    assert status == 400
    assert_openai_error(status, answer, message)


@pytest.mark.parametrize("body, message", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages"),
])
def test_invalid_chat_requests_get_400(server, body, message):
    status, answer = server.request("POST", "/v1/chat/completions", {"model": "tiny", **body})
    assert status == 400
    assert_openai_error(status, answer, message)


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/completions", {"prompt": "a", "temperature": 2.5}, "temperature", "from 0 to 2.0"),
    ("/v1/chat/completions", {"messages": HI, "temperature": 2.01}, "temperature", "from 0 to 2.0"),
    ("/v1/chat/completions", {"messages": [*HI, {"role": "wizard", "content": "hi"}]}, "messages.1.role",
     "unknown role 'wizard'"),
    ("/v1/chat/completions", {"messages": HI, "tools": [WEATHER_TOOL, WEATHER_TOOL], "tool_choice": "required"},
     "tools", "'get_weather' is given to two tools"),
    ("/v1/completions", {"prompt": "a", "response_format": {"type": "json_schema"}}, "response_format.json_schema",
     'type "json_schema" needs json_schema'),
    ("/v1/chat/completions", {"messages": HI, "response_format": {"type": "json_schema"}},
     "response_format.json_schema", 'type "json_schema" needs json_schema'),
])
def test_openais_limits_and_shapes_get_400_naming_the_field(server, path, body, param, message):
    status, answer = server.request("POST", path, {"model": "tiny", **body})
    assert status == 400, answer
    assert_openai_error(status, answer, message)
    assert answer["error"]["param"] == param, answer


def test_openais_edges_are_accepted(client):
    client.completions.create(model="tiny", prompt="a", max_tokens=1, temperature=2.0)
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "system", "content": "Be kind."},
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    client.chat.completions.create(model="tiny", messages=messages, max_tokens=1, tools=[WEATHER_TOOL],
                                   tool_choice="none")


@pytest.mark.parametrize("structured", [
    {"response_format": {"type": "json_schema"}},
    {"response_format": {"type": "json_schema", "json_schema": None}},
    {"response_format": {"type": "json_schema", "json_schema": {}}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
    {"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": {}}}},
    {"response_format": {"type": "text", "json_schema": {"name": "x", "schema": {}}}},
    {"response_format": {"type": "nope"}},
    {"response_format": {}},
    {"response_format": "json_object"},
    {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
    {"structured_outputs": {}},
    {"structured_outputs": "x"},
    {"structured_outputs": {"json": 5}},
    {"structured_outputs": {"json": "{bad"}},
    {"structured_outputs": {"json_object": "yes"}},
    {"structured_outputs": {"regex": "("}},
    {"structured_outputs": {"choice": "a"}},
    {"structured_outputs": {"grammar": ["root ::= x"]}},
    {"structured_outputs": {"regex": "a", "disable_any_whitespace": "no"}},
    {"structured_outputs": {"json": {"type": "array", "minItems": 5, "maxItems": 2}}},
    {"structured_outputs": {"bogus": 1}},
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_structured_output_shape_mistakes_get_400_naming_the_field(server, path, structured):
    base = {"prompt": "a"} if path == "/v1/completions" else {"messages": HI}
    status, answer = server.request("POST", path, {"model": "tiny", "max_tokens": 2, **base, **structured})
    assert status == 400, answer
    assert_openai_error(status, answer)
    assert answer["error"]["param"].split(".")[0] in structured, answer


def test_malformed_json_gets_400(server):
    status, answer = server.request("POST", "/v1/completions", "{not json", {"Content-Type": "application/json"})
    assert status == 400
    assert_openai_error(status, answer, "JSON")


def test_json_nested_deeper_than_the_server_reads_gets_400(server):
    schema = "[" * 20000 + "]" * 20000
    body = '{"model": "tiny", "prompt": "a", "response_format": {"type": "json_schema", "json_schema": ' \
           '{"name": "deep", "schema": {"items": ' + schema + "}}}}"
    status, answer = server.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    assert status == 400
    assert_openai_error(status, answer, "nests deeper than this server reads")


def test_unknown_model_gets_404(client):
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="gpt-4", prompt="a", max_tokens=1)
    assert error.value.status_code == 404 and "gpt-4" in error.value.message


def test_oversized_body_gets_413(server):
    status, answer = server.request("POST", "/v1/completions", b"x" * (17 * 1024 * 1024),
                                    {"Content-Type": "application/json"})
    assert status == 413
    assert_openai_error(status, answer, "limit")


def test_server_keeps_serving_after_errors(server, client):
    for _ in range(3):
        server.request("POST", "/v1/completions", {"model": "tiny", "prompt": "a", "temperature": -1})
        server.request("POST", "/v1/completions", "{", {"Content-Type": "application/json"})
    assert server.request("GET", "/health")[0] == 200
    assert client.completions.create(model="tiny", prompt="still here", max_tokens=2).usage.completion_tokens >= 1


@pytest.fixture(scope="module")
def secured_server(tied_model, tmp_path_factory):
    """A server with --api-key, on a copy of the model whose tokenizer has no chat template."""
    model = str(tmp_path_factory.mktemp("no_template") / "model")
    shutil.copytree(tied_model, model)
    config_path = os.path.join(model, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config.pop("chat_template", None)
    with open(config_path, "w") as f:
        json.dump(config, f)
    for name in os.listdir(model):
        if name.endswith(".jinja"):
            os.remove(os.path.join(model, name))
    server = Server("--model", model, "--block-size", str(BLOCK_SIZE), "--num-kvcache-blocks", "32",
                    "--max-model-len", "256", "--api-key", API_KEY)
    yield server
    try:
        assert server.stop() == 0
    finally:
        server.kill_leftovers()


def test_missing_or_wrong_api_key_gets_401(secured_server):
    status, body = secured_server.request("GET", "/v1/models")  # no Authorization header at all
    assert status == 401
    assert_openai_error(status, body, "API key")
    with openai.OpenAI(base_url=f"{secured_server.url}/v1", api_key="sk-wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError) as error:
            client.completions.create(model="tiny", prompt="a", max_tokens=1)
    assert error.value.status_code == 401
    assert secured_server.request("GET", "/health")[0] == 200  # health and metrics stay open
    assert secured_server.request("GET", "/metrics")[0] == 200
    with openai.OpenAI(base_url=f"{secured_server.url}/v1", api_key=API_KEY, max_retries=0) as client:
        assert [model.id for model in client.models.list()] == ["tiny"]


def test_the_tokenizer_endpoints_need_the_api_key_and_the_version_does_not(secured_server):
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [72]})):
        status, answer = secured_server.request("POST", path, body)
        assert status == 401
        assert_openai_error(status, answer, "API key")
        assert secured_server.request("POST", path, body, {"Authorization": f"Bearer {API_KEY}"})[0] == 200
    assert secured_server.request("GET", "/version")[0] == 200


def test_chat_without_any_template_gets_400_naming_the_flag(secured_server):
    with openai.OpenAI(base_url=f"{secured_server.url}/v1", api_key=API_KEY, max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        assert "--chat-template" in error.value.message
        assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].text is not None


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_the_bearer_scheme_is_case_insensitive(scheme, secured_server):
    status, _ = secured_server.request("GET", "/v1/models", headers={"Authorization": f"{scheme} {API_KEY}"})
    assert status == 200
    status, _ = secured_server.request("GET", "/v1/models", headers={"Authorization": f"{scheme} wrong"})
    assert status == 401
