"""Tool calls in chat completions: the grammars that force them, and the parsers that read what a model wrote.

tool_choice "required" and a named function are enforced by a grammar, as vLLM does it: "required" makes
the answer a JSON array of {"name", "parameters"} objects, one per call, each name one of the tools and
its parameters that tool's schema; a named function makes the answer that function's arguments. "auto"
lets the model choose, and the parser named by --tool-call-parser reads the calls it wrote:
- hermes (Qwen2.5, Qwen3, Hermes): each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  the text before the first one is the message's content;
- llama3_json (Llama 3.x): the answer is one JSON object {"name": ..., "parameters": {...}}, or several
  separated by ";" (after an optional <|python_tag|>).
A call is OpenAI's {"id", "type": "function", "function": {"name", "arguments": a JSON string}}.
"""
import json
import uuid
from dataclasses import dataclass

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def __post_init__(self):
        self.id = self.id or new_call_id()

    def body(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _arguments_text(arguments) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _call_of(obj, names: set[str] | None, arguments_key: str = "arguments") -> ToolCall | None:
    """A ToolCall from a parsed {"name", arguments_key} object, None if it is not one (or names a tool
    the request did not give)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    if names is not None and obj["name"] not in names:
        return None
    return ToolCall(obj["name"], _arguments_text(arguments))


def parameters_schema(tool: dict) -> dict:
    """A tool's arguments schema: a function without parameters takes none (an empty object)."""
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def required_schema(tools: list[dict], parallel: bool) -> dict:
    """tool_choice "required": a JSON array of calls, each one of the tools with its parameters."""
    choices = [{"type": "object", "properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                                                 "parameters": parameters_schema(tool)},
                "required": ["name", "parameters"]} for tool in tools]
    schema = {"type": "array", "minItems": 1, "items": choices[0] if len(choices) == 1 else {"anyOf": choices}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def parse_required(text: str) -> list[ToolCall] | None:
    """What a "required" answer (a JSON array of {"name", "parameters"}) holds; None if it does not parse."""
    try:
        calls = json.loads(text)
    except ValueError:
        return None
    if not isinstance(calls, list):
        return None
    parsed = [_call_of(call, None, "parameters") for call in calls]
    return None if any(call is None for call in parsed) else parsed


def parse_hermes(text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
    """(content before the first call, the calls) of a hermes-format answer; a block that does not parse
    stays in the content."""
    start = text.find(HERMES_START)
    if start == -1:
        return text, []
    content, calls, rest = text[:start], [], text[start:]
    while rest.startswith(HERMES_START):
        end = rest.find(HERMES_END)
        body = rest[len(HERMES_START):end if end != -1 else len(rest)]
        try:
            call = _call_of(json.loads(body), names)
        except ValueError:
            call = None
        if call is None:
            return text, []  # not calls after all: all of it is content
        calls.append(call)
        rest = "" if end == -1 else rest[end + len(HERMES_END):].lstrip()
    if rest:
        return text, []
    return content.rstrip(), calls


def parse_llama3_json(text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a llama3_json-format answer: calls only when the whole answer is call objects."""
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].strip()
    if not body.startswith("{"):
        return text, []
    calls, decoder, at = [], json.JSONDecoder(), 0
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except ValueError:
            return text, []
        call = _call_of(obj, names, "parameters")
        if call is None:
            return text, []
        calls.append(call)
        at = end
        while at < len(body) and body[at] in " \t\n;":
            at += 1
    return "", calls


PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}


class StreamedCalls:
    """An "auto" answer streamed: its text goes out as content until it may be a tool call (hermes: the
    <tool_call> tag; llama3_json: an answer that starts with "{" or the python tag); from there it is held,
    and at the end it is parsed into calls, or, if it holds none, sent as content after all."""

    def __init__(self, parser: str, names: set[str]):
        self.parser, self.names = parser, names
        self.sent = ""              # content sent so far
        self.pending = ""           # text not yet told apart (a possible start of a call)
        self.held: str | None = None  # the text from the first call on, once one started
        self.content_only = False   # llama3_json: the answer started as text, so it holds no calls

    def feed(self, delta: str) -> str:
        """The content of delta that can go out now."""
        if self.held is not None:
            self.held += delta
            return ""
        text, self.pending = self.pending + delta, ""
        if self.parser == "hermes":
            at = text.find(HERMES_START)
            if at != -1:
                self.held = text[at:]
                return self._send(text[:at])
            keep = next((n for n in range(min(len(HERMES_START) - 1, len(text)), 0, -1)
                         if text.endswith(HERMES_START[:n])), 0)
            self.pending = text[len(text) - keep:]
            return self._send(text[:len(text) - keep])
        if self.content_only:
            return self._send(text)
        head = (self.sent + text).lstrip()
        if head.startswith("{") or head.startswith(PYTHON_TAG):
            self.held = text
            return ""
        if not head or PYTHON_TAG.startswith(head):
            self.pending = text  # too little to tell yet
            return ""
        self.content_only = True
        return self._send(text)

    def _send(self, text: str) -> str:
        self.sent += text
        return text

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end: (content still to send, the calls)."""
        if self.held is None:
            return self._send(self.pending), []
        content, calls = PARSERS[self.parser](self.sent + self.held, self.names)
        if not calls:
            return self._send(self.held), []
        return content[len(self.sent):] if content.startswith(self.sent) else "", calls
