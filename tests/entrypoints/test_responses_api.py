"""/v1/responses through the real `openai` SDK (client.responses.create and .stream) against `tpengine serve`: the
same prompt, grammar, tool calls and reasoning parser as chat completions, the typed stream events building the same
response as the whole one, previous_response_id and the store, a disconnect aborting the request, and 400s naming the
field for what is not done."""
import asyncio
import json
from contextlib import contextmanager

import jsonschema
import openai
import pytest

from tests.entrypoints.conftest import running_server
from tests.entrypoints.test_structured import SCHEMA_OF, TOOLS
from tpengine.entrypoints.responses import ResponseStore, StoredResponse

# a reasoning server may open its thinking with its first token: greedy, this random model does not
# ChatML, the thinking opened by the template (as DeepSeek-R1's does) when the instructions start with "Think":
# a random model never opens its own
TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] or '' }}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if messages[0]['role'] == 'system' and messages[0]['content'].startswith('Think') %}<think>\n"
            "{% endif %}{% endif %}")
FUNCTION_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]
GREEDY = dict(model="tiny", temperature=0.0)
EVENT_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta", "response.output_text.done",
               "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def responses_server(thinking_model):
    yield from running_server(thinking_model, "--reasoning-parser", "qwen3", "--enable-auto-tool-choice",
                              "--tool-call-parser", "hermes", "--chat-template", TEMPLATE)


@pytest.fixture(scope="module")
def client(responses_server):
    with openai.OpenAI(base_url=f"{responses_server.url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def chat_reply(client, messages, **kwargs):
    return client.chat.completions.create(messages=messages, **GREEDY, **kwargs).choices[0]


def without_ids(items: list[dict]) -> list[dict]:
    """Output items less their ids (and the SDK stream helper's parsed text)."""
    return [{k: [{**part, "parsed": None} for part in v] if k == "content" else v for k, v in item.items()
             if k not in ("id", "call_id")} for item in items]


def test_plain_text_is_the_chat_completions_reply(client):
    response = client.responses.create(input="Say something.", instructions="You are terse.", max_output_tokens=8,
                                       **GREEDY)
    chat = chat_reply(client, [{"role": "system", "content": "You are terse."},
                               {"role": "user", "content": "Say something."}], max_completion_tokens=8)
    assert response.object == "response" and response.id.startswith("resp_")
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text == chat.message.content
    assert response.status == ("incomplete" if chat.finish_reason == "length" else "completed")
    assert response.usage.output_tokens <= 8 and response.usage.input_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert response.usage.output_tokens_details.reasoning_tokens == 0


def test_a_forced_tool_call_validates_and_its_result_feeds_back(client):
    for name in ("get_weather", "get_time"):
        response = client.responses.create(input="What is the weather in Paris?", tools=FUNCTION_TOOLS,
                                           tool_choice={"type": "function", "name": name}, max_output_tokens=200,
                                           **GREEDY)
        [call] = response.output
        assert call.type == "function_call" and call.name == name and call.call_id and response.status == "completed"
        jsonschema.validate(json.loads(call.arguments), SCHEMA_OF[name])
    # the call and its result go through the template as chat's assistant tool_calls and tool message
    given = [{"role": "user", "content": "What time is it?"}, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}]
    followed = client.responses.create(input=given, tools=FUNCTION_TOOLS, tool_choice="none", max_output_tokens=6,
                                       **GREEDY)
    chat = chat_reply(client, [given[0], {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "12:00"}], tools=TOOLS, tool_choice="none",
        max_completion_tokens=6)
    assert followed.output_text == chat.message.content


def test_required_calls_stream_their_arguments_after_the_thinking(client):
    # greedy, the model opens its thinking here, then calls once the grammar holds
    with client.responses.stream(input="Use a tool.", tools=FUNCTION_TOOLS, tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=100, **GREEDY) as stream:
        events = list(stream)
        response = stream.get_final_response()
    assert [item.type for item in response.output] == ["reasoning", "function_call"]
    call = response.output[1]
    jsonschema.validate(json.loads(call.arguments), SCHEMA_OF[call.name])
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == call.arguments == done[0].arguments


def test_a_json_schema_output_validates(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                               "rain": {"type": "boolean"}}, "required": ["city", "rain"]}
    for prompt in ("Weather in Paris as JSON.", "And in Rome?"):
        text = {"format": {"type": "json_schema", "name": "weather", "schema": schema}}
        response = client.responses.create(input=prompt, max_output_tokens=200, text=text, **GREEDY)
        jsonschema.validate(json.loads(response.output_text), schema)
        assert response.status == "completed" and response.text.format.type == "json_schema"


def test_a_reasoning_models_thinking_is_a_reasoning_item(client):
    response = client.responses.create(input="Why?", instructions="Think first.", max_output_tokens=10, **GREEDY)
    chat = chat_reply(client, [{"role": "system", "content": "Think first."}, {"role": "user", "content": "Why?"}],
                      max_completion_tokens=10)
    reasoning = [item for item in response.output if item.type == "reasoning"]
    assert len(reasoning) == 1 and response.output[0].type == "reasoning"
    assert reasoning[0].content[0].type == "reasoning_text"
    assert reasoning[0].content[0].text == chat.message.reasoning_content
    assert response.output_text == (chat.message.content or "")
    if chat.finish_reason == "length" and not chat.message.content:  # the thinking ran to the limit
        assert response.usage.output_tokens_details.reasoning_tokens == response.usage.output_tokens == 10
    # its items passed back as input: the assistant's turn, its thinking as reasoning_content
    given = [{"role": "user", "content": "Why?"}, *[item.model_dump(exclude_none=True) for item in response.output],
             {"role": "user", "content": "Really?"}]
    again = client.responses.create(input=given, instructions="You are terse.", max_output_tokens=5, **GREEDY)
    chat = chat_reply(client, [{"role": "system", "content": "You are terse."}, given[0],
                               {"role": "assistant", "content": response.output_text,
                                "reasoning_content": reasoning[0].content[0].text}, given[-1]],
                      max_completion_tokens=5)
    assert again.output_text == chat.message.content


def events_response(events) -> dict:
    """The output items and status that a client assembling the raw typed events gets."""
    items: dict[int, dict] = {}
    for event in events:
        if event.type == "response.output_item.added":
            items[event.output_index] = event.item.model_dump(exclude_none=True)
        elif event.type in ("response.output_text.delta", "response.reasoning_text.delta"):
            items[event.output_index]["content"][event.content_index]["text"] += event.delta
        elif event.type == "response.content_part.added":
            items[event.output_index]["content"].append(event.part.model_dump(exclude_none=True))
        elif event.type == "response.function_call_arguments.delta":
            items[event.output_index]["arguments"] += event.delta
        elif event.type == "response.output_item.done":
            assert {**items[event.output_index], "status": None} == {**event.item.model_dump(exclude_none=True),
                                                                      "status": None}
            items[event.output_index] = event.item.model_dump(exclude_none=True)
    return {"output": [items[i] for i in sorted(items)], "status": events[-1].response.status}


@pytest.mark.parametrize("instructions", ["You are terse.", "Think first."])
def test_streamed_events_build_the_non_streamed_response(client, instructions):
    kwargs = dict(input="Say something.", instructions=instructions, max_output_tokens=12, **GREEDY)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == ("response.completed" if whole.status == "completed" else "response.incomplete")
    assert [event.sequence_number for event in events] == list(range(len(events)))
    if instructions == "You are terse.":
        assert [k for k in EVENT_ORDER if k in kinds] == sorted(set(kinds) & set(EVENT_ORDER), key=kinds.index)
    built = events_response(events)
    assert without_ids(built["output"]) == without_ids(whole.model_dump(exclude_none=True)["output"])
    assert built["status"] == whole.status
    streamed_usage = events[-1].response.usage  # its prompt now in the prefix cache: cached_tokens may differ
    assert (streamed_usage.input_tokens, streamed_usage.output_tokens, streamed_usage.output_tokens_details) == \
        (whole.usage.input_tokens, whole.usage.output_tokens, whole.usage.output_tokens_details)


def test_the_sdks_stream_helper_gets_the_whole_response(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    kwargs = dict(input="Is it ok?", max_output_tokens=50, text={"format": {"type": "json_schema", "name": "ok",
                                                                              "schema": schema}}, **GREEDY)
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        text = "".join(event.delta for event in stream if event.type == "response.output_text.delta")
        streamed = stream.get_final_response()
    assert text == streamed.output_text == whole.output_text and json.loads(text) in ({"ok": True}, {"ok": False})
    assert without_ids(streamed.model_dump()["output"]) == without_ids(whole.model_dump()["output"])


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(input="My name is Ada.", instructions="You are terse.", max_output_tokens=5,
                                    **GREEDY)
    second = client.responses.create(input="What is my name?", previous_response_id=first.id, max_output_tokens=5,
                                     **GREEDY)
    # the instructions are not carried over (OpenAI's rule); the earlier input and output are
    chat = chat_reply(client, [{"role": "user", "content": "My name is Ada."},
                               {"role": "assistant", "content": first.output_text},
                               {"role": "user", "content": "What is my name?"}], max_completion_tokens=5)
    assert second.previous_response_id == first.id and second.output_text == chat.message.content
    assert second.usage.input_tokens > first.usage.input_tokens


def test_a_stored_response_is_retrieved_and_deleted(client, responses_server):
    response = client.responses.create(input="Keep this.", max_output_tokens=3, metadata={"k": "v"}, **GREEDY)
    assert client.responses.retrieve(response.id) == response and response.metadata == {"k": "v"}
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(response.id)
    unstored = client.responses.create(input="Forget this.", max_output_tokens=3, store=False, **GREEDY)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(input="Go on.", previous_response_id=unstored.id, max_output_tokens=3)
    assert error.value.body["param"] == "previous_response_id"


def running(server) -> float:
    return server.metric("tpengine:num_requests_running", model_name="tiny")


def aborted(server) -> float:
    return server.metric("tpengine:request_success_total", model_name="tiny", finished_reason="abort")


# a grammar that keeps a random model writing (no end of sequence before its 400 characters)
LONG = {"format": {"type": "json_schema", "name": "long", "schema": {"type": "string", "pattern": "^[a-z]{400}$"}}}


def test_a_client_that_disconnects_aborts_its_request(client, responses_server):
    before = aborted(responses_server)
    stream = client.responses.create(input="Go.", max_output_tokens=480, text=LONG, stream=True, **GREEDY)
    for _, _event in zip(range(5), stream):
        pass
    assert running(responses_server) == 1
    stream.close()
    responses_server.wait_for_metric("tpengine:num_requests_running", 0.0, model_name="tiny")
    async_client = openai.AsyncOpenAI(base_url=f"{responses_server.url}/v1", api_key="unused", max_retries=0)

    async def start_then_cancel():
        call = asyncio.ensure_future(async_client.responses.create(input="Go on.", max_output_tokens=480, text=LONG,
                                                                   **GREEDY))
        while running(responses_server) == 0:
            await asyncio.sleep(0.02)
        call.cancel()

    asyncio.run(start_then_cancel())
    responses_server.wait_for_metric("tpengine:num_requests_running", 0.0, model_name="tiny")
    assert aborted(responses_server) - before == 2


def test_responses_count_in_metrics(client, responses_server):
    before = {name: responses_server.metric(f"tpengine:{name}_total", model_name="tiny")
              for name in ("prompt_tokens", "generation_tokens")}
    response = client.responses.create(input="Count me.", max_output_tokens=4, **GREEDY)
    assert responses_server.metric("tpengine:prompt_tokens_total", model_name="tiny") - before["prompt_tokens"] == \
        response.usage.input_tokens
    assert responses_server.metric("tpengine:generation_tokens_total", model_name="tiny") - \
        before["generation_tokens"] == response.usage.output_tokens


@pytest.mark.parametrize("body, param, words", [
    ({"tools": [{"type": "web_search"}]}, "tools", "'web_search'"),
    ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools", "'code_interpreter'"),
    ({"background": True}, "background", "background mode"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "'item_reference'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
     "reads no images"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]}, "input", "input_file"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort", "reasoning effort"),
    ({"tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice", "'allowed_tools'"),
    ({"previous_response_id": "resp_unknown"}, "previous_response_id", "resp_unknown"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": FUNCTION_TOOLS}, "tool_choice", "'nope'"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "schema"),
    ({"include": ["reasoning.encrypted_content"]}, "include", "include"),
    ({"top_logprobs": 3}, "top_logprobs", "log-probabilities"),
    ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
    ({"conversation": "conv_1"}, "conversation", "conversations"),
    ({"frequency_penalty": 1.0}, "frequency_penalty", "unknown field"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options", "stream is true"),
    ({"tools": FUNCTION_TOOLS, "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
     "tool_choice", "cannot also"),
])
def test_what_is_not_done_is_a_400_naming_the_field(responses_server, body, param, words):
    status, answer = responses_server.request("POST", "/v1/responses", {"model": "tiny", "input": "Hi.", **body})
    assert status == 400, answer
    assert answer["error"]["param"].startswith(param) and words in answer["error"]["message"], answer


def test_a_stored_response_is_whole_and_an_unknown_one_404(responses_server):
    status, answer = responses_server.request("GET", "/v1/responses/resp_x?stream=true")
    assert status == 400 and answer["error"]["param"] == "stream"
    assert responses_server.request("GET", "/v1/responses/resp_x")[0] == 404


def test_a_tp2_server_answers_responses_as_its_chat_completions(tied_model):
    with contextmanager(running_server)(tied_model, "--tp", "2") as server, \
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as tp2:
        whole = tp2.responses.create(input="Say something.", max_output_tokens=8, **GREEDY)
        streamed = list(tp2.responses.create(input="Say something.", max_output_tokens=8, stream=True, **GREEDY))
        chat = chat_reply(tp2, [{"role": "user", "content": "Say something."}], max_completion_tokens=8)
    assert whole.output_text == chat.message.content == "".join(
        event.delta for event in streamed if event.type == "response.output_text.delta")


def test_the_store_forgets_the_least_recently_used_response_past_its_cap():
    store = ResponseStore(max_responses=2)
    for name in ("a", "b"):
        store.put(StoredResponse({"id": name}, []))
    assert store.get("a") is not None  # now "b" is the least recently used
    store.put(StoredResponse({"id": "c"}, []))
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None and len(store) == 2
    assert store.delete("a") and not store.delete("a") and len(store) == 1
