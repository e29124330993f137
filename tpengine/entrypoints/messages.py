"""Anthropic's Messages API, POST /v1/messages and /v1/messages/count_tokens: the request is translated into a chat
completion's and run by chat completions' own path (chat.py: the chat template, the tool-call grammars and readers,
the reasoning parser); the reply comes back as Anthropic's content blocks, whole or as Anthropic's events.

One reply is read one way: its deltas become content-block events, and a whole message is those events folded as a
streaming client folds them, so a streamed and a whole message agree. tool_choice "any" is chat's "required" and
{"type": "tool"} a named function (a grammar: the input validates against the tool's input_schema); `thinking` turns
the template's enable_thinking on and, with --reasoning-parser, the thinking comes apart as a thinking block, cut at
budget_tokens (stop_reason "max_tokens") if it has not ended by then.
"""
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Annotated, Any, Literal

import msgspec
from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator
from starlette.requests import Request
from starlette.responses import StreamingResponse

from tpengine.entrypoints.async_engine import EngineDeadError
from tpengine.entrypoints.chat import ChatRun, ChoiceReader, OpenAIServingChat
from tpengine.entrypoints.protocol import ChatCompletionRequest, OpenAIBody
from tpengine.entrypoints.serving import ApiError, StreamUsage, cancel_on_disconnect, choice_deltas, engine_down

MAX_TEMPERATURE = 1.0  # Anthropic's range is [0, 1]
# Blocks of Anthropic's that carry what this server's models do not read (an image model reads image blocks)
REFUSED_BLOCKS = ("document", "search_result", "container_upload", "server_tool_use", "web_search_tool_result",
                  "redacted_thinking")
# Anthropic's error type for an HTTP status; any other is "api_error"
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error"}
# chat completions' finish reasons as Anthropic's stop reasons ("stop" is end_turn, or stop_sequence for a string)
STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}


def error_body(error: ApiError) -> dict:
    """An error in Anthropic's shape."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(error.status, "api_error"), "message": error.message}}


def content_blocks(content):
    """A string as one text block; a list refused if it holds a block this server cannot read, naming it."""
    if type(content) is str:
        return [{"type": "text", "text": content}]
    if type(content) is not list:
        raise ValueError("must be a string or a list of content blocks")
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in REFUSED_BLOCKS:
            raise ValueError(f"block {i} is of type {kind!r}, which is not supported: this server reads text, "
                             "image, tool_use, tool_result and thinking blocks")
    return content


def text_blocks(content):
    """A tool result's or the system prompt's blocks: text only (an image there is refused, naming it)."""
    blocks = content_blocks(content)
    for i, block in enumerate(blocks):
        if isinstance(block, dict) and block.get("type") == "image":
            raise ValueError(f"block {i} is an image: images are read in a user message's content, not here")
    return blocks


class CacheControl(OpenAIBody):
    """Anthropic's prompt-cache mark: the prefix cache keeps every prompt's blocks anyway, so it asks for nothing."""
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(OpenAIBody):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: Annotated[list, Field(max_length=0)] | None = None  # none are made, so none come back


class ImageSource(OpenAIBody):
    """An image as Anthropic sends it: base64 data of a media type, or a URL (a data: or file:// one: nothing is
    fetched over the network)."""
    type: Literal["base64", "url"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"] | None = None
    data: str | None = None
    url: str | None = None

    @model_validator(mode="after")
    def _one_form(self):
        if self.type == "base64" and (self.media_type is None or self.data is None or self.url is not None):
            raise ValueError("a base64 image source needs media_type and data (and no url)")
        if self.type == "url" and (self.url is None or self.data is not None):
            raise ValueError("a url image source needs url (and no data)")
        return self

    @property
    def chat_url(self) -> str:
        """The image_url a chat completion reads it by."""
        return self.url if self.type == "url" else f"data:{self.media_type};base64,{self.data}"


class ImageBlock(OpenAIBody):
    type: Literal["image"]
    source: ImageSource
    cache_control: CacheControl | None = None


class ToolUseBlock(OpenAIBody):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(OpenAIBody):
    type: Literal["tool_result"]
    tool_use_id: str
    content: list[TextBlock] = []
    is_error: bool = False
    cache_control: CacheControl | None = None

    _blocks = field_validator("content", mode="before")(text_blocks)

    @property
    def text(self) -> str:
        text = "".join(block.text for block in self.content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(OpenAIBody):
    type: Literal["thinking"]
    thinking: str
    signature: str = ""  # this server signs nothing: a thinking block it wrote comes back with ""


ContentBlock = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock,
                         Field(discriminator="type")]


class Message(OpenAIBody):
    role: Literal["user", "assistant"]
    content: list[ContentBlock]

    _blocks = field_validator("content", mode="before")(content_blocks)

    @model_validator(mode="after")
    def _blocks_fit_the_role(self):
        wrong = {"user": ("tool_use", "thinking"), "assistant": ("tool_result", "image")}[self.role]
        for block in self.content:
            if block.type in wrong:
                raise ValueError(f"a {self.role} message cannot hold a {block.type} block")
        return self


class Tool(OpenAIBody):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None


class ToolChoice(OpenAIBody):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_goes_with_tool(self):
        if (self.name is None) == (self.type == "tool"):
            raise ValueError('a name goes with type "tool", and only with it')
        return self


class ThinkingConfig(OpenAIBody):
    type: Literal["enabled", "adaptive", "disabled"]  # adaptive: the model chooses whether to think, no budget
    budget_tokens: int | None = Field(None, ge=1)
    display: Literal["summarized"] | None = None  # the thinking is returned as it was written

    @model_validator(mode="after")
    def _budget_goes_with_enabled(self):
        if (self.budget_tokens is None) == (self.type == "enabled"):
            raise ValueError('budget_tokens goes with type "enabled", and only with it')
        return self

    @property
    def enabled(self) -> bool:
        return self.type != "disabled"


class Metadata(OpenAIBody):
    user_id: str | None = None  # an identifier: it changes no answer


class MessagesPrompt(OpenAIBody):
    """What is rendered into the prompt: POST /v1/messages/count_tokens' body, and /v1/messages' first fields."""
    model: str
    messages: list[Message] = Field(min_length=1)
    system: list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None

    _system = field_validator("system", mode="before")(lambda v: v if v is None else text_blocks(v))

    @field_validator("tool_choice")
    @classmethod
    def _choice_names_a_tool(cls, choice, info: ValidationInfo):
        names = [tool.name for tool in info.data.get("tools") or ()]
        if choice is not None and choice.type in ("any", "tool") and not names:
            raise ValueError(f"tool_choice {choice.type!r} needs tools")
        if choice is not None and choice.name is not None and choice.name not in names:
            raise ValueError(f"names the tool {choice.name!r}, which is not among the tools")
        return choice

    @model_validator(mode="after")
    def _thinking_is_not_forced_past(self):
        # as Anthropic refuses it: a forced tool call is the whole answer, with no room to think first
        if self.thinking_enabled and self.tool_choice is not None and self.tool_choice.type in ("any", "tool"):
            raise ValueError('thinking cannot be enabled when tool_choice forces a tool call ("any" or "tool")')
        return self

    @property
    def thinking_enabled(self) -> bool:
        return self.thinking is not None and self.thinking.enabled

    @property
    def thinking_budget(self) -> int | None:
        return self.thinking.budget_tokens if self.thinking is not None else None


class MessagesRequest(MessagesPrompt):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE)
    top_k: int | None = None
    top_p: float | None = None
    stream: bool = False
    metadata: Metadata | None = None

    @field_validator("max_tokens")
    @classmethod
    def _room_to_answer_after_thinking(cls, max_tokens, info: ValidationInfo):
        thinking = info.data.get("thinking")
        if thinking is not None and thinking.budget_tokens is not None and thinking.budget_tokens >= max_tokens:
            raise ValueError(f"must be greater than thinking.budget_tokens ({thinking.budget_tokens}), as Anthropic "
                             "requires")
        return max_tokens


def chat_messages(prompt: MessagesPrompt) -> list[dict[str, Any]]:
    """The conversation as chat completions' messages: system first, a tool_result as a "tool" message, an assistant's
    tool_use blocks as its tool_calls and its thinking as its reasoning_content (which templates read)."""
    messages = [{"role": "system", "content": "".join(b.text for b in prompt.system)}] if prompt.system else []
    for message in prompt.messages:
        if message.role == "assistant":
            messages.append(assistant_message(message.content))
            continue
        parts = None
        for block in message.content:  # tool results, text and images, in their order
            if block.type == "tool_result":
                messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text})
                parts = None
                continue
            if parts is None:  # a user message's parts: text alone is joined into one string (ChatMessage)
                parts = []
                messages.append({"role": "user", "content": parts})
            parts.append({"type": "text", "text": block.text} if block.type == "text" else
                         {"type": "image_url", "image_url": {"url": block.source.chat_url}})
    return messages


def assistant_message(blocks: list) -> dict[str, Any]:
    message = {"role": "assistant", "content": "".join(b.text for b in blocks if b.type == "text")}
    thinking = "".join(b.thinking for b in blocks if b.type == "thinking")
    if thinking:
        message["reasoning_content"] = thinking
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
             for b in blocks if b.type == "tool_use"]
    if calls:
        message["tool_calls"] = calls
    return message


def chat_request(prompt: MessagesPrompt, max_request_len: int) -> ChatCompletionRequest:
    """The chat completion request that runs this one; a whole message is read from its streamed deltas."""
    body: dict[str, Any] = {"model": prompt.model, "messages": chat_messages(prompt),
                            "chat_template_kwargs": {"enable_thinking": prompt.thinking_enabled}}
    if prompt.tools:
        body["tools"] = [{"type": "function", "function": {"name": tool.name, "parameters": tool.input_schema,
                                                           **({"description": tool.description}
                                                              if tool.description is not None else {})}}
                         for tool in prompt.tools]
    choice = prompt.tool_choice
    if choice is not None:
        body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
            {"type": "function", "function": {"name": choice.name}}
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    if isinstance(prompt, MessagesRequest):
        sampling = dict(stop=prompt.stop_sequences, temperature=prompt.temperature, top_k=prompt.top_k,
                        top_p=prompt.top_p)
        body.update({name: value for name, value in sampling.items() if value is not None},
                    max_tokens=prompt.max_tokens, stream=True)
    try:
        return ChatCompletionRequest.model_validate(body, context={"max_request_len": max_request_len})
    except ValidationError as e:  # a limit chat completions keep (the number of messages, of stop strings)
        raise ApiError(400, "; ".join(f"{'.'.join(map(str, p['loc']))}: {p['msg']}" for p in e.errors())) from None


class BlockWriter:
    """A reply's message deltas (ChoiceReader's) as content-block events: a block starts with its first text and
    stops when one of another kind (or another tool call) starts, or the reply ends."""

    def __init__(self):
        self.index = -1
        self.kind: str | None = None  # the type of the block that is open

    def write(self, delta: dict) -> list[dict]:
        events = []
        if delta.get("reasoning_content"):
            events += self._continue("thinking", {"thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            events += self._continue("text", {"text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for entry in delta.get("tool_calls", ()):
            if "id" in entry:  # a call starts
                events += self._open("tool_use", {"id": entry["id"], "name": entry["function"]["name"], "input": {}})
            if entry["function"].get("arguments"):
                events.append(self._delta({"type": "input_json_delta", "partial_json": entry["function"]["arguments"]}))
        return events

    def _continue(self, kind: str, fields: dict) -> list[dict]:
        return [] if self.kind == kind else self._open(kind, fields)

    def _open(self, kind: str, fields: dict) -> list[dict]:
        events = self.close()
        self.index, self.kind = self.index + 1, kind
        start = {"type": "content_block_start", "index": self.index, "content_block": {"type": kind, **fields}}
        return [*events, start]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def close(self) -> list[dict]:
        if self.kind is None:
            return []
        self.kind = None
        return [{"type": "content_block_stop", "index": self.index}]


def still_thinking(reader: ChoiceReader) -> bool:
    return reader.reasoning is not None and reader.reasoning.state == "thinking"


def stop_reason(reader: ChoiceReader, finish_reason: str | None, stop: int | str | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished reply."""
    finish = reader.finish_reason(finish_reason)
    if finish not in STOP_REASONS:  # aborted: the server is stopping
        raise ApiError(503, "the request was aborted before its reply ended", "service_unavailable")
    if finish == "stop" and isinstance(stop, str):
        return "stop_sequence", stop
    return STOP_REASONS[finish], None


async def message_events(run: ChatRun, message: dict, thinking_budget: int | None) -> AsyncIterator[dict]:
    """Anthropic's events of the run's reply: message_start, each block's start, deltas and stop, message_delta
    (stop_reason and usage), message_stop."""
    yield {"type": "message_start", "message": {**message, "usage": {"input_tokens": len(run.prompt),
                                                                    "output_tokens": 0}}}
    reader, blocks, counts = run.reader(), BlockWriter(), StreamUsage()
    reason = None
    try:
        async for delta in choice_deltas(run.submission, 1, counts):
            completion = delta.completion
            finished = completion.finish_reason is not None
            for event in blocks.write(reader.delta(completion.text or "", finished)):
                yield event
            if finished:
                reason = stop_reason(reader, completion.finish_reason, completion.stop_reason)
                break
            if thinking_budget is not None and still_thinking(reader) and counts.completion_tokens >= thinking_budget:
                for event in blocks.write(reader.delta("", True)):  # the thinking held back, if any
                    yield event
                reason = "max_tokens", None
                break
    except EngineDeadError as e:
        raise engine_down(e) from None
    finally:
        run.submission.abort()  # a no-op once finished; else the thinking ran past its budget, or the client left
    if reason is None:
        raise ApiError(503, "the request was aborted before its reply ended", "service_unavailable")
    for event in blocks.close():
        yield event
    yield {"type": "message_delta", "delta": {"stop_reason": reason[0], "stop_sequence": reason[1]},
           "usage": {"output_tokens": counts.completion_tokens}}
    yield {"type": "message_stop"}


def tool_input(text: str) -> dict:
    """A tool_use block's input from its JSON text; a call cut short by max_tokens (not whole JSON) has none."""
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


async def whole_message(events: AsyncIterator[dict]) -> dict:
    """The message the events build, as a streaming client assembles it."""
    message: dict = {}
    json_texts: dict[int, str] = {}  # tool_use blocks' input as it came
    async with aclosing(events):
        async for event in events:
            kind = event["type"]
            if kind == "message_start":
                message = event["message"]
            elif kind == "content_block_start":
                message["content"].append(dict(event["content_block"]))
            elif kind == "content_block_delta":
                index, delta = event["index"], event["delta"]
                if delta["type"] == "input_json_delta":
                    json_texts[index] = json_texts.get(index, "") + delta["partial_json"]
                else:
                    key = delta["type"].removesuffix("_delta")  # text or thinking
                    message["content"][index][key] += delta[key]
            elif kind == "content_block_stop" and message["content"][event["index"]]["type"] == "tool_use":
                message["content"][event["index"]]["input"] = tool_input(json_texts.get(event["index"], ""))
            elif kind == "message_delta":
                message.update(event["delta"])
                message["usage"].update(event["usage"])
    return message


async def event_stream(events: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    """Server-sent events as Anthropic names them; an error after the stream began is an `error` event."""
    async with aclosing(events):
        try:
            async for event in events:
                yield b"event: " + event["type"].encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"
        except ApiError as e:
            yield b"event: error\ndata: " + msgspec.json.encode(error_body(e)) + b"\n\n"


class AnthropicServingMessages:
    """POST /v1/messages and /v1/messages/count_tokens, run by chat completions' serving."""

    def __init__(self, chat: OpenAIServingChat, max_request_len: int):
        self.chat, self.max_request_len = chat, max_request_len

    async def create(self, request: MessagesRequest, raw_request: Request):
        if request.thinking_enabled and self.chat.reasoning_parser is None:
            raise ApiError(400, "thinking needs the server started with --reasoning-parser", param="thinking")
        # a thinking budget counts tokens as they come: deltas one step at a time, so none runs past it unseen
        run = await self.chat.start(chat_request(request, self.max_request_len),
                                    by_step=request.thinking_budget is not None)
        message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                   "model": self.chat.response_model(request.model), "content": [], "stop_reason": None,
                   "stop_sequence": None}
        events = message_events(run, message, request.thinking_budget)
        if request.stream:
            return StreamingResponse(event_stream(events), media_type="text/event-stream")
        return await cancel_on_disconnect(raw_request, whole_message(events))

    async def count_tokens(self, request: MessagesPrompt) -> dict:
        """The prompt's tokens, as /v1/messages would run it."""
        self.chat.check_model(request.model)
        return {"input_tokens": len(await self.chat.render_prompt(chat_request(request, self.max_request_len)))}
