"""POST /v1/responses run as a chat completion (OpenAIServingChat.start: the chat template, structured outputs, tool
calls and the reasoning parser), its reply read by chat's ChoiceReader into output items: a `reasoning` item (the
thinking, with --reasoning-parser), a `message` (output_text), `function_call`s. A streamed reply's typed events
build exactly those items; a whole reply is read as one final piece, so both end in the same response."""
import copy
import time
import uuid
from collections.abc import AsyncIterator

import msgspec
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import StreamingResponse

from tpengine.entrypoints.async_engine import EngineDeadError, Submission
from tpengine.entrypoints.chat import ChoiceReader, OpenAIServingChat
from tpengine.entrypoints.responses import ResponsesRequest, ResponseStore, StoredResponse, chat_messages
from tpengine.entrypoints.serving import (ApiError, StreamUsage, cancel_on_disconnect, choice_deltas, engine_down,
                                          final_outputs, usage)

# chat's field names -> the Responses API's, for the errors chat's checks raise
FIELDS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
          "response_format": "text.format"}
# an item kind's content part and the events that stream its text
PARTS = {"message": ("output_text", "response.output_text"), "reasoning": ("reasoning_text", "response.reasoning_text")}
ID_PREFIXES = {"message": "msg", "reasoning": "rs", "function_call": "fc"}


def renamed(error: ApiError) -> ApiError:
    """A chat check's error, naming the Responses API's field."""
    param = error.param or ""
    head, _, rest = param.partition(".")
    if head in FIELDS:
        error.param = FIELDS[head] + (f".{rest}" if rest else "")
    return error


class OutputItems:
    """A response's output items, built from a reply's message deltas (ChoiceReader's): feed() and close() give the
    stream events that build them. An item is done when one of another kind starts. (One way a stream's items may
    differ from the whole reply's: hermes text written after a call is a message item after it when streamed, and
    joins the message before the calls when read whole, as chat's content joins it.)"""

    def __init__(self):
        self.items: list[dict] = []
        self.open: dict | None = None

    def feed(self, delta: dict) -> list[dict]:
        events = []
        if delta.get("reasoning_content"):
            events += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for entry in delta.get("tool_calls", ()):
            if "id" in entry:  # a new call
                events += self._start({"type": "function_call", "call_id": entry["id"],
                                       "name": entry["function"]["name"], "arguments": ""})
            arguments = entry["function"].get("arguments")
            if arguments:
                self.open["arguments"] += arguments
                events.append(self._event("response.function_call_arguments.delta", delta=arguments))
        return events

    def close(self, status: str = "completed") -> list[dict]:
        """The open item's done events; status: "incomplete" when the reply was cut short."""
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        if item["type"] == "function_call":
            events = [{"type": "response.function_call_arguments.done", **where, "name": item["name"],
                       "arguments": item["arguments"]}]
        else:
            part = item["content"][0]
            extra = {"logprobs": []} if item["type"] == "message" else {}
            events = [{"type": f"{PARTS[item['type']][1]}.done", **where, "content_index": 0, "text": part["text"],
                       **extra},
                      {"type": "response.content_part.done", **where, "content_index": 0, "part": copy.deepcopy(part)}]
        return events + [{"type": "response.output_item.done", "output_index": where["output_index"],
                          "item": copy.deepcopy(item)}]

    def _start(self, item: dict) -> list[dict]:
        events = self.close()
        item = {"id": f"{ID_PREFIXES[item['type']]}_{uuid.uuid4().hex}", **item, "status": "in_progress"}
        self.items.append(item)
        self.open = item
        events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                       "item": copy.deepcopy(item)})
        if item["type"] in PARTS:
            part = {"type": PARTS[item["type"]][0], "text": ""}
            if item["type"] == "message":
                part.update(annotations=[], logprobs=[])
            item["content"].append(part)
            events.append(self._event("response.content_part.added", content_index=0, part=copy.deepcopy(part)))
        return events

    def _text(self, kind: str, text: str) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != kind:
            fields = {"role": "assistant", "content": []} if kind == "message" else {"summary": [], "content": []}
            events += self._start({"type": kind, **fields})
        self.open["content"][0]["text"] += text
        extra = {"logprobs": []} if kind == "message" else {}
        events.append(self._event(f"{PARTS[kind][1]}.delta", content_index=0, delta=text, **extra))
        return events

    def _event(self, kind: str, **fields) -> dict:
        return {"type": kind, "item_id": self.open["id"], "output_index": len(self.items) - 1, **fields}


def sse_event(event: dict, sequence_number: int) -> bytes:
    """One typed event as OpenAI streams it: its type as the SSE event name too."""
    return (b"event: " + event["type"].encode() + b"\ndata: "
            + msgspec.json.encode({**event, "sequence_number": sequence_number}) + b"\n\n")


def responses_usage(chat_usage: dict, reasoning_tokens: int) -> dict:
    """Chat's usage field in the Responses API's words."""
    return {"input_tokens": chat_usage["prompt_tokens"], "input_tokens_details": chat_usage["prompt_tokens_details"],
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens}, "total_tokens": chat_usage["total_tokens"]}


class Reply:
    """One response in the making: its body, its output items, how its reply is read, and the conversation (chat
    messages, instructions aside) it continues."""

    def __init__(self, body: dict, reader: ChoiceReader, conversation: list[dict]):
        self.body, self.items, self.reader, self.conversation = body, OutputItems(), reader, conversation
        self.token_ids: list[int] = []

    def feed(self, text: str, token_ids: list[int], finished: bool) -> list[dict]:
        self.token_ids += token_ids
        return self.items.feed(self.reader.delta(text, finished))

    def finish(self, finish_reason: str | None, chat_usage: dict, think_end: int | None) -> list[dict]:
        """The last items' done events; the body becomes the finished response."""
        incomplete = finish_reason == "length"
        events = self.items.close("incomplete" if incomplete else "completed")
        self.body.update(status="incomplete" if incomplete else "completed", output=self.items.items,
                         incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
                         usage=responses_usage(chat_usage, self._reasoning_tokens(think_end)))
        return events

    def _reasoning_tokens(self, think_end: int | None) -> int:
        """The reply's tokens up to its </think> (all of them if its thinking never ended); 0 if it did not think."""
        if self.reader.reasoning is None or not self.reader.reasoning.thinking:
            return 0
        return self.token_ids.index(think_end) + 1 if think_end in self.token_ids else len(self.token_ids)


class OpenAIServingResponses:
    """POST /v1/responses, and GET/DELETE /v1/responses/{id} of the stored ones."""

    def __init__(self, chat: OpenAIServingChat, max_request_len: int, store: ResponseStore | None = None):
        self.chat = chat
        self.max_request_len = max_request_len
        self.store = ResponseStore() if store is None else store

    async def create(self, request: ResponsesRequest, raw_request: Request):
        history: list[dict] = []
        if request.previous_response_id is not None:
            previous = self.store.get(request.previous_response_id)
            if previous is None:
                raise ApiError(400, f"no stored response has the id {request.previous_response_id!r:.80} (it was "
                                    "never stored, was deleted, or was forgotten: the store keeps the "
                                    f"{self.store.max_responses} most recently used)", param="previous_response_id")
            history = previous.conversation
        try:
            chat_request = request.chat_request(history, self.max_request_len)
        except ValidationError as e:
            problem = e.errors(include_input=False)[0]
            field = ".".join(map(str, problem["loc"]))
            raise renamed(ApiError(400, f"{field}: {problem['msg'].removeprefix('Value error, ')}", param=field))
        try:
            run = await self.chat.start(chat_request)
        except ApiError as e:
            raise renamed(e) from None
        reply = Reply(self._new_body(request), run.reader(), history + chat_messages(request.input_items()))
        if request.stream:
            return StreamingResponse(self._stream(request, reply, run.submission), media_type="text/event-stream")
        return await cancel_on_disconnect(raw_request, self._complete(request, reply, run.submission))

    def retrieve(self, response_id: str) -> dict:
        return self._stored(response_id).body

    def delete(self, response_id: str) -> dict:
        self._stored(response_id)
        self.store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    def _stored(self, response_id: str) -> StoredResponse:
        stored = self.store.get(response_id)
        if stored is None:
            raise ApiError(404, f"no stored response has the id {response_id!r:.80}", "not_found_error",
                           "response_id", "response_not_found")
        return stored

    def _new_body(self, request: ResponsesRequest) -> dict:
        """The response's fields, before its output: what it was asked for, as OpenAI echoes it."""
        text_format = request.text.format if request.text is not None else None
        return {"id": f"resp_{uuid.uuid4().hex}", "object": "response",
                "created_at": int(time.time()),
                "model": self.chat.response_model(request.model), "status": "in_progress", "background": False,
                "error": None, "incomplete_details": None, "instructions": request.instructions,
                "max_output_tokens": request.max_output_tokens, "metadata": request.metadata or {}, "output": [],
                "parallel_tool_calls": request.parallel_tool_calls is not False,
                "previous_response_id": request.previous_response_id, "reasoning": {"effort": None, "summary": None},
                "store": request.stored,
                # the values sampling used: SamplingParams' defaults where the request left them out
                "temperature": 1.0 if request.temperature is None else request.temperature,
                "top_p": 1.0 if request.top_p is None else request.top_p,
                "text": {"format": {"type": "text"} if text_format is None
                         else text_format.model_dump(by_alias=True, exclude_none=True)},
                "tool_choice": (request.tool_choice if isinstance(request.tool_choice, str)
                                else request.tool_choice.model_dump() if request.tool_choice is not None
                                else "auto" if request.tools else "none"),
                "tools": [tool.model_dump(exclude_none=True) for tool in request.tools or ()],
                "truncation": "disabled", "usage": None, "user": request.user}

    def _keep(self, request: ResponsesRequest, reply: Reply) -> None:
        if request.stored:
            self.store.put(StoredResponse(reply.body, reply.conversation + chat_messages(reply.items.items)))

    @property
    def _think_end(self) -> int | None:
        tokens = self.chat.engine.engine.reasoning_tokens
        return None if tokens is None else tokens[1]

    async def _complete(self, request: ResponsesRequest, reply: Reply, submission: Submission) -> dict:
        output = (await final_outputs(submission))[0]
        completion = output.outputs[0]
        reply.feed(completion.text or "", list(completion.token_ids), finished=True)
        reply.finish(completion.finish_reason, usage([output]), self._think_end)
        self._keep(request, reply)
        return reply.body

    async def _stream(self, request: ResponsesRequest, reply: Reply, submission: Submission) -> AsyncIterator[bytes]:
        sequence_number = 0

        def encoded(events: list[dict]) -> bytes:
            nonlocal sequence_number
            chunks = [sse_event(event, sequence_number + i) for i, event in enumerate(events)]
            sequence_number += len(events)
            return b"".join(chunks)

        counts, finish_reason = StreamUsage(), None
        try:
            yield encoded([{"type": kind, "response": copy.deepcopy(reply.body)}
                           for kind in ("response.created", "response.in_progress")])
            async for delta in choice_deltas(submission, 1, counts):
                completion = delta.completion
                finish_reason = completion.finish_reason or finish_reason
                events = reply.feed(completion.text or "", list(completion.token_ids),
                                    completion.finish_reason is not None)
                if events:
                    yield encoded(events)
            events = reply.finish(finish_reason, counts.field(), self._think_end)
            self._keep(request, reply)
            kind = "response.completed" if reply.body["status"] == "completed" else "response.incomplete"
            yield encoded([*events, {"type": kind, "response": reply.body}])
        except (EngineDeadError, ApiError) as e:
            error = (engine_down(e) if isinstance(e, EngineDeadError) else e).body()["error"]
            yield encoded([{"type": "error", "code": error["code"], "message": error["message"],
                            "param": error["param"]}])
        finally:
            submission.abort()  # a no-op once finished; else the client went away
