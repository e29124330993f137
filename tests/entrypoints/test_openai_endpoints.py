"""The endpoints beside generation, through the real server: a model by its id (the client's models.retrieve),
and vLLM's /tokenize, /detokenize and /version."""
import importlib.metadata

import openai
import pytest

from tests.entrypoints.test_errors import assert_openai_error

GREEDY = dict(model="tiny", max_tokens=1, temperature=0.0, extra_body={"return_token_ids": True})
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"}]


def test_models_retrieve_gives_the_served_model_and_404_for_another(client):
    model = client.models.retrieve("tiny")
    assert model.id == "tiny" and model.object == "model"
    assert model.model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as error:
        client.models.retrieve("gpt-4")
    assert "gpt-4" in error.value.message and error.value.body["code"] == "model_not_found"


def test_tokenize_gives_the_prompt_token_ids_a_completion_or_chat_would_run(server, client):
    status, tokenized = server.request("POST", "/tokenize", {"model": "tiny", "prompt": "def foo():"})
    completion = client.completions.create(prompt="def foo():", **GREEDY)
    assert status == 200 and tokenized == {"count": len(completion.choices[0].prompt_token_ids), "max_model_len": 512,
                                           "tokens": completion.choices[0].prompt_token_ids, "token_strs": None}
    status, tokenized = server.request("POST", "/tokenize", {"messages": MESSAGES, "return_token_strs": True})
    chat = client.chat.completions.create(messages=MESSAGES, **GREEDY)
    assert status == 200 and tokenized["tokens"] == chat.choices[0].prompt_token_ids
    assert tokenized["count"] == chat.usage.prompt_tokens == len(tokenized["token_strs"])
    status, without = server.request("POST", "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert status == 200 and without["tokens"] == tokenized["tokens"][:without["count"]] < tokenized["tokens"]
    # vLLM's `vllm bench serve` tokenizes so, to align its random prompts with the server's tokenizer
    status, plain = server.request("POST", "/tokenize", {"model": "tiny", "prompt": "def foo():",
                                                         "add_special_tokens": False})
    completion = client.completions.create(prompt="def foo():", **{**GREEDY, "extra_body": {
        "return_token_ids": True, "add_special_tokens": False}})
    assert status == 200 and plain["tokens"] == completion.choices[0].prompt_token_ids


def test_detokenize_gives_back_the_text_of_tokenized_ids(server):
    text = "Hello, wörld!\n"
    tokens = server.request("POST", "/tokenize", {"prompt": text})[1]["tokens"]
    assert server.request("POST", "/detokenize", {"model": "tiny", "tokens": tokens}) == (200, {"prompt": text})
    assert server.request("POST", "/detokenize", {"tokens": []}) == (200, {"prompt": ""})


@pytest.mark.parametrize("path, body, status, param, message", [
    ("/detokenize", {"tokens": [72, 10**6]}, 400, "tokens", "1000000 is outside the vocabulary"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens", "token ids (integers >= 0)"),
    ("/detokenize", {"tokens": "hi"}, 400, "tokens", "token ids"),
    ("/detokenize", {"tokens": [1] * 513}, 400, "tokens", "limit of 512"),
    ("/detokenize", {"model": "gpt-4", "tokens": [1]}, 404, "model", "gpt-4"),
    ("/tokenize", {"model": "gpt-4", "prompt": "a"}, 404, "model", "gpt-4"),
    ("/tokenize", {"prompt": ["a"]}, 400, "prompt", "string"),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, 400, "add_generation_prompt", "unknown field"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role", "'wizard'"),
    ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}}, 400, "chat_template_kwargs",
     "tokenize"),
])
def test_tokenizer_endpoints_refuse_what_they_cannot_do_naming_the_field(server, path, body, status, param, message):
    answer_status, answer = server.request("POST", path, body)
    assert answer_status == status, answer
    assert_openai_error(answer_status, answer, message)
    assert answer["error"]["param"] == param, answer


def test_version_is_tpengines(server):
    assert server.request("GET", "/version") == (200, {"version": importlib.metadata.version("tpengine")})
