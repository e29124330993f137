"""POST /v1/responses (OpenAI's Responses API): the request body, its translation into a chat completion request (the
chat template, structured outputs, tool calls and the reasoning parser are chat's: responses_serving.py runs it), and
the store that keeps responses for previous_response_id and GET/DELETE /v1/responses/{id}.

As for the other endpoints, every field declared here is honoured, and any other is a 400 naming it; the fields of
what this server does not do (background mode, built-in tools, conversations, prompt templates) are declared so that
a value asking for them is a 400 saying so.
"""
from collections import OrderedDict
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, ValidationInfo, field_validator, model_validator

from tpengine.entrypoints.protocol import (MAX_TEMPERATURE, UNSUPPORTED, ChatCompletionRequest, OpenAIBody,
                                           StreamOptions, refusing, stream_options_need_stream)

# How many responses the store keeps (store: true, OpenAI's default): past it the least recently used one goes.
MAX_STORED_RESPONSES = 1024
# OpenAI's limits on metadata: up to 16 pairs, keys up to 64 characters, values up to 512.
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
TEXT_PARTS = ("input_text", "output_text")
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")

# Fields of what this server does not do: field -> (the values that ask for nothing, why not).
RESPONSES_UNSUPPORTED = {
    "background": (lambda v: v is None or v is False, "background mode is not supported: send background false"),
    "conversation": (lambda v: v is None, "conversations are not supported: continue one with previous_response_id"),
    "include": (lambda v: not v, "include is not supported (nothing extra can be included): send [] or leave it out"),
    "max_tool_calls": (lambda v: v is None, "max_tool_calls is not supported: parallel_tool_calls false allows one"),
    "prompt": (lambda v: v is None, "prompt templates are not supported: send input and instructions"),
    "prompt_cache_retention": (lambda v: v is None, "prompt_cache_retention is not supported: the prefix cache keeps "
                                                    "what fits"),
    "top_logprobs": (lambda v: v is None or v == 0, "log-probabilities are not returned by /v1/responses (ask "
                                                    "/v1/chat/completions)"),
    "truncation": (lambda v: v in (None, "disabled"), 'truncation "auto" is not supported: an input over the '
                                                      'context is a 400 ("disabled")'),
    "context_management": (lambda v: not v, "context_management is not supported"),
    "service_tier": UNSUPPORTED["service_tier"],
}


_refuse = refusing(RESPONSES_UNSUPPORTED)


class InputText(OpenAIBody):
    type: Literal[TEXT_PARTS]
    text: str
    annotations: list[Any] | None = None  # an output_text part passed back: its annotations and log-probabilities
    logprobs: list[Any] | None = None


class InputImage(OpenAIBody):
    """An image an image model reads (a data: URL, or a file:// one under --allowed-local-media-path)."""
    type: Literal["input_image"]
    image_url: str
    detail: Literal["auto", "low", "high"] | None = None  # the image processor decides the resolution


def _parts_of(kinds: tuple[str, ...]):
    """A content validator: a list's parts must be of these kinds (refused by name)."""
    def check(content):
        for part in content if type(content) is list else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in kinds:
                raise ValueError(f"a content part has type {kind!r:.60}, which is not supported: only "
                                 f"{', '.join(kinds)}")
        return content
    return check


_text_parts_only = _parts_of(TEXT_PARTS)


class MessageItem(OpenAIBody):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText | InputImage]
    id: str | None = None
    status: str | None = None

    _parts = field_validator("content", mode="before")(_parts_of((*TEXT_PARTS, "input_image")))

    @model_validator(mode="after")
    def _images_in_user_messages(self):
        if self.role != "user" and not isinstance(self.content, str) and \
                any(part.type == "input_image" for part in self.content):
            raise ValueError(f"a {self.role} message cannot hold an input_image: images are read in user messages")
        return self


class FunctionCallItem(OpenAIBody):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(OpenAIBody):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None

    _parts = field_validator("output", mode="before")(_text_parts_only)


class ReasoningText(OpenAIBody):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(OpenAIBody):
    type: Literal["reasoning"]
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None
    id: str | None = None
    status: str | None = None
    encrypted_content: None = None   # only this server's own reasoning, in the clear


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
                      Field(discriminator="type")]


class FunctionTool(OpenAIBody):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None   # the grammar enforces the schema whatever it says (chat's tools alike)


class FunctionChoice(OpenAIBody):
    type: Literal["function"]
    name: str


class TextFormat(OpenAIBody):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    # validate_default: a "json_schema" type without its schema is refused here, not found missing later
    schema_: dict[str, Any] | None = Field(None, alias="schema", validate_default=True)
    strict: bool | None = None

    @field_validator("schema_")
    @classmethod
    def _schema_goes_with_json_schema(cls, schema, info: ValidationInfo):
        if (schema is not None) != (info.data.get("type") == "json_schema"):
            raise ValueError('a schema goes with type "json_schema", which needs one: {"type": "json_schema", '
                             '"name": ..., "schema": {...}}')
        return schema


def _only_null(why: str):
    """A validator refusing any value but null, saying why."""
    def refuse(value):
        if value is not None:
            raise ValueError(f"{why} (got {value!r:.80})")
        return value
    return refuse


class TextConfig(OpenAIBody):
    format: TextFormat | None = None
    verbosity: Any = None

    _verbosity = field_validator("verbosity")(_only_null("verbosity is not supported"))


class ReasoningConfig(OpenAIBody):
    """Only its neutral values: with --reasoning-parser, the thinking comes back as a reasoning item."""
    effort: Any = None
    summary: Any = None
    generate_summary: Any = None

    _effort = field_validator("effort")(_only_null(
        "reasoning effort is not supported: a model thinks as its chat template lets it (with --reasoning-parser "
        "the thinking comes back as a reasoning item)"))
    _summary = field_validator("summary", "generate_summary")(_only_null(
        "reasoning summaries are not supported: with --reasoning-parser the whole thinking comes back as a "
        "reasoning item"))


def _with_item_types(items):
    """Items without a type are messages (OpenAI's easy form); an unknown type is refused by name."""
    if type(items) is not list:
        return items
    typed = []
    for i, item in enumerate(items):
        if isinstance(item, dict):
            kind = item.get("type", "message")
            if kind not in ITEM_TYPES:
                raise ValueError(f"item {i} has type {kind!r:.60}, which is not supported: input items are "
                                 f"{', '.join(ITEM_TYPES)}")
            item = {**item, "type": kind}
        typed.append(item)
    return typed


def _function_choice_only(tool_choice):
    if isinstance(tool_choice, dict) and tool_choice.get("type") != "function":
        raise ValueError(f"tool_choice type {tool_choice.get('type')!r:.60} is not supported: tool_choice is "
                         '"none", "auto", "required" or {"type": "function", "name": ...}')
    return tool_choice


def _function_tools_only(tools):
    for tool in tools if type(tools) is list else ():
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise ValueError(f"tool type {kind!r:.60} is not supported: only function tools (built-in tools such as "
                             "web search, file search and the code interpreter are not)")
    return tools


class ResponsesRequest(OpenAIBody):
    model: str | None = None
    # a string, or items: the one its type picks is checked, so an error names what is wrong with the items
    input: Annotated[Annotated[str, Tag("str")] | Annotated[list[InputItem], Tag("list[item]")],
                     Discriminator(lambda v: "str" if isinstance(v, str) else "list[item]")]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = None
    # None: "auto" with tools, else "none" (OpenAI's defaults)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool | None = None   # None: true
    metadata: Annotated[dict[Annotated[str, Field(max_length=MAX_METADATA_KEY)],
                             Annotated[str, Field(max_length=MAX_METADATA_VALUE)]],
                        Field(max_length=MAX_METADATA_PAIRS)] | None = None
    # identifiers: they change no answer
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    background: Any = None
    conversation: Any = None
    include: Any = None
    max_tool_calls: Any = None
    prompt: Any = None
    prompt_cache_retention: Any = None
    top_logprobs: Any = None
    truncation: Any = None
    context_management: Any = None
    service_tier: Any = None

    _unsupported = field_validator(*RESPONSES_UNSUPPORTED)(_refuse)
    _item_types = field_validator("input", mode="before")(_with_item_types)
    _tool_types = field_validator("tools", mode="before")(_function_tools_only)
    _tool_choice_type = field_validator("tool_choice", mode="before")(_function_choice_only)

    _stream_options = field_validator("stream_options")(stream_options_need_stream)

    @property
    def stored(self) -> bool:
        return self.store is not False

    def input_items(self) -> list[dict]:
        """The input as items (dicts, as output items are)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return [item.model_dump(by_alias=True, exclude_none=True) for item in self.input]

    def chat_request(self, history: list[dict], max_request_len: int) -> ChatCompletionRequest:
        """The chat completion request this one runs as: instructions as the system message, then the earlier
        conversation (history: chat messages) and the input."""
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions is not None else [])
        body = {"model": self.model, "messages": messages + history + chat_messages(self.input_items()),
                "stream": self.stream, "max_completion_tokens": self.max_output_tokens,
                "temperature": self.temperature, "top_p": self.top_p, "parallel_tool_calls": self.parallel_tool_calls,
                "user": self.user, "safety_identifier": self.safety_identifier,
                "prompt_cache_key": self.prompt_cache_key}
        if self.tools:
            body["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                             for tool in self.tools]
        if self.tool_choice is not None:
            body["tool_choice"] = (self.tool_choice if isinstance(self.tool_choice, str)
                                   else {"type": "function", "function": {"name": self.tool_choice.name}})
        if self.text is not None and self.text.format is not None:
            body["response_format"] = response_format(self.text.format)
        return ChatCompletionRequest.model_validate(body, context={"max_request_len": max_request_len})


def response_format(text_format: TextFormat) -> dict:
    """text.format as chat's response_format."""
    if text_format.type != "json_schema":
        return {"type": text_format.type}
    json_schema = {"name": text_format.name or "response", "schema": text_format.schema_}
    if text_format.strict is not None:
        json_schema["strict"] = text_format.strict
    return {"type": "json_schema", "json_schema": json_schema}


def _text(content) -> str:
    return content if isinstance(content, str) else "".join(part["text"] for part in content)


def _user_content(content):
    """A message's content as chat reads it: text joined, or with images the chat's text and image_url parts."""
    if isinstance(content, str) or all(part["type"] in TEXT_PARTS for part in content):
        return _text(content)
    return [{"type": "image_url", "image_url": {"url": part["image_url"]}} if part["type"] == "input_image"
            else {"type": "text", "text": part["text"]} for part in content]


def chat_messages(items: list[dict]) -> list[dict]:
    """Input or output items as chat messages: an assistant's consecutive items (its reasoning, text and function
    calls) make one assistant message, a function_call_output a tool message."""
    messages: list[dict] = []

    def assistant_turn() -> dict:
        if not messages or messages[-1]["role"] != "assistant":
            messages.append({"role": "assistant", "content": ""})
        return messages[-1]

    for item in items:
        kind = item["type"]
        if kind == "message" and item["role"] != "assistant":
            messages.append({"role": item["role"], "content": _user_content(item["content"])})
        elif kind == "message":
            assistant_turn()["content"] += _text(item["content"])
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item["output"])})
        elif kind == "function_call":
            assistant_turn().setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
        else:  # reasoning: the templates that show earlier thinking read reasoning_content (else its summary)
            turn = assistant_turn()
            thinking = _text(item.get("content") or item.get("summary") or [])
            turn["reasoning_content"] = turn.get("reasoning_content", "") + thinking
    return messages


class StoredResponse:
    def __init__(self, body: dict, conversation: list[dict]):
        self.body = body                  # the response as it was answered
        self.conversation = conversation  # its chat messages, instructions aside, its output included


class ResponseStore:
    """The responses kept for previous_response_id and GET/DELETE /v1/responses/{id}: at most max_responses, the
    least recently used one forgotten past that. In memory: a restart forgets them all."""

    def __init__(self, max_responses: int = MAX_STORED_RESPONSES):
        self.max_responses = max_responses
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._responses)

    def put(self, response: StoredResponse) -> None:
        self._responses[response.body["id"]] = response
        self._responses.move_to_end(response.body["id"])
        while len(self._responses) > self.max_responses:
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        response = self._responses.get(response_id)
        if response is not None:
            self._responses.move_to_end(response_id)
        return response

    def delete(self, response_id: str) -> bool:
        return self._responses.pop(response_id, None) is not None
