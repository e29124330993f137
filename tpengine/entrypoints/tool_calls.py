"""Tool calls in chat completions: the grammars that force them, and the readers that take what a model wrote apart
into content and calls.

tool_choice "required" and a named function are enforced by a grammar, as vLLM does it: "required" makes
the answer a JSON array of {"name", "parameters"} objects, one per call, each name one of the tools and
its parameters that tool's schema; a named function makes the answer that function's arguments. "auto"
lets the model choose, and the parser named by --tool-call-parser reads the calls it wrote:
- hermes (Qwen2.5, Qwen3, Hermes): each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
  the text outside the blocks is the message's content (the whitespace next to a block is not);
- llama3_json (Llama 3.x): the answer is one JSON object {"name": ..., "parameters": {...}}, or several
  separated by ";" (after an optional <|python_tag|>).
A call is OpenAI's {"id", "type": "function", "function": {"name", "arguments": a JSON string}}.

A reply is read as it is written, and a whole reply is read the same way, so streamed and whole replies hold the
same content and calls. "required", named and hermes calls go out as they are written: a call once its name is
read and its arguments start, then their text as it grows; a reply cut short (max_tokens) keeps the calls it
began, the last one's arguments the text written so far (finish_reason "length"). llama3_json calls are read when
the answer is whole.
"""
import json
import re
import uuid
from dataclasses import dataclass

from tpengine.entrypoints.reasoning import held_back

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
# a call object's start as models (and the "required" grammar) write it: its name, then its arguments' first character
CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')


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


class Brackets:
    """The bracket depth of JSON text read a piece at a time (brackets inside strings do not count)."""

    def __init__(self):
        self.depth = 0
        self.in_string = self.escaped = False

    def close_at(self, text: str) -> int | None:
        """Read text; where (the index after) the brackets opened before close, else None (all of it read)."""
        for i, char in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return i + 1
        return None


class CallObject:
    """One call's JSON object, {"name": ..., "arguments" (or "parameters"): {...}}, read as it is written: its name
    once the arguments start, then their text as it grows. An object written otherwise (arguments first, or
    arguments that are not an object or array) is read when it is whole."""

    def __init__(self):
        self.text = ""
        self.brackets = Brackets()  # the object's own: it ends where they close
        self.closed = False
        self.head_name: str | None = None     # the name, once CALL_HEAD is read
        self.arguments_at: int | None = None  # where the arguments' value starts in text
        self.value: Brackets | None = None    # an object or array value's brackets: its text streams
        self.arguments_end: int | None = None  # where that value ends, once it has
        self.index: int | None = None  # its place among the reply's calls, once it went out
        self.sent = 0                  # how much of its arguments went out

    def feed(self, text: str) -> int:
        """Read text up to the object's end; how many of its characters it took."""
        if self.closed:
            return 0
        end = self.brackets.close_at(text)
        taken = len(text) if end is None else end
        unread = len(self.text)  # where the arguments' value is read from
        self.text += text[:taken]
        self.closed = end is not None
        if self.arguments_at is None:
            head = CALL_HEAD.match(self.text)
            try:
                self.head_name = None if head is None else json.loads(head.group(1))
            except ValueError:
                pass  # not a JSON string: the object is read when it is whole
            if self.head_name is None:
                return taken
            self.arguments_at = unread = head.end()
            if self.text[unread] in "{[":
                self.value = Brackets()
        if self.value is not None and self.arguments_end is None:
            end = self.value.close_at(self.text[unread:])
            if end is not None:
                self.arguments_end = unread + end
        return taken

    def whole(self) -> ToolCall | None:
        """The call the whole object is, None if it is not one."""
        try:
            return _call_of(json.loads(self.text), None)
        except ValueError:
            return None

    @property
    def name(self) -> str | None:
        if self.head_name is not None:
            return self.head_name
        call = self.whole() if self.closed else None
        return None if call is None else call.name

    def arguments(self) -> str | None:
        """The arguments' text written so far; None while it cannot tell (a value that is not an object or array
        is read when the object is whole)."""
        if self.value is not None:
            return self.text[self.arguments_at:self.arguments_end]
        call = self.whole() if self.closed else None
        return None if call is None else call.arguments


class CallsReader:
    """An answer read as it is written into content and tool calls: feed() gives what each piece adds (a streamed
    delta's content and tool_calls entries), and a whole answer is one final feed. This one reads it all as content
    (no tool calls asked for)."""

    def __init__(self):
        self.content = ""               # the content so far
        self.calls: list[ToolCall] = []  # the calls so far; the last one's arguments may still grow
        self._entries: list[dict] = []  # tool_calls delta entries not yet handed out

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        """(content, tool_calls delta entries) new since the last feed; final: the answer ended."""
        content = self._read(text, final)
        self.content += content
        entries, self._entries = self._entries, []
        return content, entries

    def _read(self, text: str, final: bool) -> str:
        """Take text in; returns the content that can go out now."""
        return text

    def _open(self, name: str) -> int:
        """Start a call; its index."""
        call = ToolCall(name, "")
        self.calls.append(call)
        self._entries.append({"index": len(self.calls) - 1, "id": call.id, "type": "function",
                              "function": {"name": name, "arguments": ""}})
        return len(self.calls) - 1

    def _write(self, arguments: str) -> None:
        """More of the last call's arguments."""
        if not arguments:
            return
        index = len(self.calls) - 1
        self.calls[index].arguments += arguments
        if self._entries and self._entries[-1]["index"] == index:
            self._entries[-1]["function"]["arguments"] += arguments
        else:
            self._entries.append({"index": index, "function": {"arguments": arguments}})

    def _follow(self, call: CallObject) -> None:
        """Send what is new of an opened call object: its arguments as they grow."""
        arguments = call.arguments()
        if arguments is not None:
            self._write(arguments[call.sent:])
            call.sent = len(arguments)


class NamedCall(CallsReader):
    """A named function: the whole answer is its arguments (its grammar's); the call goes out with their first text."""

    def __init__(self, function: str):
        super().__init__()
        self.function = function

    def _read(self, text: str, final: bool) -> str:
        if text:
            if not self.calls:
                self._open(self.function)
            self._write(text)
        return ""


class RequiredCalls(CallsReader):
    """tool_choice "required": the answer is a JSON array of {"name", "parameters"} objects (its grammar's), each a
    call that goes out as it is written."""

    def __init__(self):
        super().__init__()
        self.item: CallObject | None = None  # the call being read
        self.ended = False  # the array closed

    def _read(self, text: str, final: bool) -> str:
        while text and not self.ended:
            if self.item is None:
                text = text.lstrip(" \t\r\n[,")  # the array's punctuation between calls
                if not text:
                    break
                if text[0] != "{":
                    self.ended = True  # "]"
                    break
                self.item = CallObject()
            text = text[self.item.feed(text):]
            if self.item.index is None and self.item.name is not None:
                self.item.index = self._open(self.item.name)
            if self.item.index is not None:
                self._follow(self.item)
            if self.item.closed:
                self.item = None
        return ""


class HermesCalls(CallsReader):
    """hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; the text outside them is content
    (the whitespace next to a block is not). A block naming one of the tools goes out as a call once its name is
    read and its arguments start; one that names none of them, or is not a call, is content when it ends (held
    until then); with parallel_tool_calls false, blocks after the first call are dropped."""

    def __init__(self, names: set[str], parallel: bool):
        super().__init__()
        self.names, self.parallel = names, parallel
        self.pending = ""      # text not yet told apart: a possible tag start, whitespace a block may follow
        self.block: CallObject | None = None  # the block being read
        self.block_text = ""   # its text, the content if it is not a call
        self.rejected = False  # the block names a tool the request did not give
        self.dropped = False   # the block is a call beyond the first, with parallel_tool_calls false
        self.after_block = False  # the whitespace after a block is not content

    def _read(self, text: str, final: bool) -> str:
        text, self.pending = self.pending + text, ""
        content = ""
        while text:
            if self.block is None:
                if self.after_block:
                    text = text.lstrip()
                    if not text:
                        break
                    self.after_block = False
                at = text.find(HERMES_START)
                if at == -1:
                    kept = text if final else text[:len(text) - held_back(text, HERMES_START)].rstrip()
                    content += kept
                    self.pending = text[len(kept):]
                    break
                before = text[:at].rstrip()
                content += before
                # the whitespace before the block is content only if the block is not a call
                self.block, self.block_text = CallObject(), text[len(before):at + len(HERMES_START)]
                self.rejected = self.dropped = False
                text = text[at + len(HERMES_START):]
            else:
                end = text.find(HERMES_END)
                body = text if end == -1 else text[:end]
                if end == -1 and not final:
                    keep = held_back(body, HERMES_END)
                    body, self.pending = body[:len(body) - keep], body[len(body) - keep:]
                self.block_text += body
                self.block.feed(body)
                self._send_block()
                if end == -1:
                    if final:
                        content += self._end_block()
                    break
                self.block_text += HERMES_END
                content += self._end_block()
                text = text[end + len(HERMES_END):]
        return content

    def _send_block(self) -> None:
        block = self.block
        if block.index is None and not (self.rejected or self.dropped):
            name = block.name
            if name is None:
                return
            if name not in self.names:
                self.rejected = True
            elif self.calls and not self.parallel:
                self.dropped = True
            else:
                block.index = self._open(name)
        if block.index is not None:
            self._follow(block)

    def _end_block(self) -> str:
        """The content a block that ended gives: its text, if it was not a call."""
        block, self.block = self.block, None
        self.after_block = block.index is not None or self.dropped
        return "" if self.after_block else self.block_text


class Llama3JsonCalls(CallsReader):
    """llama3_json: an answer that starts with "{" or the python tag is held and read as calls when it is whole (its
    objects separated by ";"); any other answer is content as it comes."""

    def __init__(self, names: set[str], parallel: bool):
        super().__init__()
        self.names, self.parallel = names, parallel
        self.held: str | None = None  # the answer, once it may be calls
        self.pending = ""             # too little to tell yet
        self.content_only = False     # the answer started as text: it holds no calls

    def _read(self, text: str, final: bool) -> str:
        if self.held is None and not self.content_only:
            text, self.pending = self.pending + text, ""
            head = text.lstrip()
            if head.startswith("{") or head.startswith(PYTHON_TAG):
                self.held = ""
            elif (not head or PYTHON_TAG.startswith(head)) and not final:
                self.pending = text
                return ""
            else:
                self.content_only = True
        if self.held is None:
            return text
        self.held += text
        if not final:
            return ""
        content, calls = parse_llama3_json(self.held, self.names)
        if not calls:
            return self.held
        for call in calls if self.parallel else calls[:1]:
            self._open(call.name)
            self._write(call.arguments)
        return content


# --tool-call-parser NAME: the reader of an "auto" answer
AUTO_READERS = {"hermes": HermesCalls, "llama3_json": Llama3JsonCalls}
TOOL_CALL_PARSERS = tuple(AUTO_READERS)
