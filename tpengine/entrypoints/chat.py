"""POST /v1/chat/completions: messages (and tools) through the chat template, whole responses or server-sent
events; a reasoning model's thinking split off (--reasoning-parser), tool calls forced by a grammar or read
from what the model wrote (tool_calls.py)."""
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse

from tpengine.entrypoints.async_engine import Submission
from tpengine.entrypoints.protocol import ChatCompletionRequest, NamedToolChoice
from tpengine.entrypoints.reasoning import ReasoningSplitter, split_reasoning
from tpengine.entrypoints.serving import (ApiError, ChoiceDelta, OpenAIServing, cancel_on_disconnect, clamp_logprob,
                                          final_outputs, new_response_fields, sse_stream, token_id_fields, usage)
from tpengine.entrypoints.tool_calls import (PARSERS, StreamedCalls, ToolCall, new_call_id, parameters_schema,
                                             parse_required, required_schema)
from tpengine.outputs import CompletionOutput
from tpengine.sampling_params import StructuredOutputsParams

ROLE = "assistant"


def template_messages(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as a chat template reads them: an assistant's tool calls with their arguments as objects
    (OpenAI sends them as JSON text; templates write them out as JSON)."""
    messages = [m.template_dict() for m in request.messages]
    for message in messages:
        for call in message.get("tool_calls") or ():
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except ValueError:
                    pass  # not JSON: the template gets the text
    return messages


class ToolMode:
    """How a request's answer may hold tool calls: "none", "auto" (read by the server's parser), "required"
    (a grammar: a JSON array of calls) or "named" (a grammar: that function's arguments)."""

    def __init__(self, request: ChatCompletionRequest, parser: str | None):
        choice = request.effective_tool_choice
        self.names = {tool.function.name for tool in request.tools or ()}
        self.parallel = request.parallel_tool_calls is not False
        self.parser = parser
        self.function = choice.function.name if isinstance(choice, NamedToolChoice) else None
        self.kind = "named" if self.function is not None else choice

    def grammar(self, request: ChatCompletionRequest) -> StructuredOutputsParams | None:
        # compact JSON: arguments are read by programs, and a model cannot wander off into whitespace
        if self.kind == "required":
            tools = [tool.model_dump(exclude_none=True) for tool in request.tools]
            return StructuredOutputsParams(json=required_schema(tools, self.parallel), disable_any_whitespace=True)
        if self.kind == "named":
            tool = next(t for t in request.tools if t.function.name == self.function)
            return StructuredOutputsParams(json=parameters_schema(tool.model_dump(exclude_none=True)),
                                           disable_any_whitespace=True)
        return None

    def calls(self, answer: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole answer."""
        if self.kind == "named":
            return None, [ToolCall(self.function, answer)]
        if self.kind == "required":
            calls = parse_required(answer)
            return (answer, []) if calls is None else (None, calls)
        if self.kind == "auto":
            content, calls = PARSERS[self.parser](answer, self.names)
            return content, calls if self.parallel else calls[:1]
        return answer, []


class StreamedChoice:
    """One choice's stream: its text split into reasoning and answer, the answer into content and calls."""

    def __init__(self, mode: ToolMode, reasoning_parser: str | None):
        self.mode = mode
        self.reasoning = None if reasoning_parser is None else ReasoningSplitter(reasoning_parser)
        self.auto = StreamedCalls(mode.parser, mode.names) if mode.kind == "auto" else None
        self.answer = ""                  # required: held whole until the end
        self.named_id: str | None = None  # named: the call's id once its first chunk went out
        self.num_calls = 0

    def delta(self, text: str, finished: bool) -> dict:
        """The chunk's delta for the completion's new text (and its end)."""
        reasoning, answer = (("", text) if self.reasoning is None else self.reasoning.feed(text, final=finished))
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        content, calls = "", []
        kind = self.mode.kind
        if kind == "named":
            if answer or (finished and self.named_id is None):
                call = {"index": 0, "function": {"arguments": answer}}
                if self.named_id is None:
                    self.named_id = new_call_id()
                    call.update(id=self.named_id, type="function", function={"name": self.mode.function,
                                                                             "arguments": answer})
                delta["tool_calls"] = [call]
        elif kind == "required":
            self.answer += answer
            if finished:
                content, calls = self.mode.calls(self.answer)
                content = content or ""
        elif kind == "auto":
            content = self.auto.feed(answer)
            if finished:
                rest, calls = self.auto.finish()
                content += rest
                calls = calls if self.mode.parallel else calls[:1]
        else:
            content = answer
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [{"index": self.num_calls + i, **call.body()} for i, call in enumerate(calls)]
            self.num_calls += len(calls)
        return delta

    @property
    def called(self) -> bool:
        return self.named_id is not None or self.num_calls > 0


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *args, tool_parser: str | None = None, enable_auto_tool_choice: bool = False,
                 reasoning_parser: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.tool_parser = tool_parser                  # --tool-call-parser: how "auto" answers are read
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.reasoning_parser = reasoning_parser        # --reasoning-parser: <think>...</think> kept apart

    def request_field(self, param: str | None, request: ChatCompletionRequest) -> str | None:
        if param == "prompt":
            return "messages"
        if param == "max_tokens":
            return "max_tokens" if request.max_completion_tokens is None else "max_completion_tokens"
        if param == "logprobs":
            return "top_logprobs"
        return param

    async def create(self, request: ChatCompletionRequest, raw_request: Request):
        self.check_model(request.model)
        mode = ToolMode(request, self.tool_parser)
        if mode.kind == "auto" and not (self.enable_auto_tool_choice and self.tool_parser):
            raise ApiError(400, 'tool_choice "auto" (the default with tools) needs the server started with '
                                '--enable-auto-tool-choice and --tool-call-parser', param="tool_choice")
        spec = await self.request_grammar(request)
        if mode.kind in ("required", "named"):
            if spec is not None:
                raise ApiError(400, f"tool_choice {mode.kind!r} makes the answer a tool call: it cannot also "
                                    "follow response_format or structured_outputs", param="tool_choice")
            spec = await self.checked_grammar(mode.grammar(request), "tools", request)
        prompt = await self._render_prompt(request)
        max_tokens = self.max_tokens(request.max_completion_tokens or request.max_tokens, [prompt], request)
        params = self.sampling_params(request, max_tokens, request.num_logprobs, spec)
        submission = await self.submit([prompt], params, request)
        if request.stream:
            fields = {**new_response_fields("chatcmpl", self.model_name), "object": "chat.completion.chunk"}
            return StreamingResponse(self._stream(request, mode, submission, fields), media_type="text/event-stream")
        fields = {**new_response_fields("chatcmpl", self.model_name), "object": "chat.completion"}
        return await cancel_on_disconnect(raw_request, self._complete(request, mode, submission, fields))

    async def render(self, request: ChatCompletionRequest) -> dict:
        """POST /v1/chat/completions/render (vLLM's): the prompt's token ids through the chat template, generating
        nothing. vLLM's router asks for them to route a request by its tokens' prefix (cache_aware)."""
        self.check_model(request.model)
        return {"request_id": new_response_fields("chatcmpl", self.model_name)["id"], "model": self.model_name,
                "token_ids": await self._render_prompt(request)}

    async def _render_prompt(self, request: ChatCompletionRequest) -> list[int]:
        tools = [tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools else None
        try:
            return await self.renderer.render_chat(template_messages(request), request.add_generation_prompt,
                                                   request.chat_template_kwargs, tools)
        except ValueError as e:
            raise self.invalid(e, request) from None

    def _logprobs(self, completion: CompletionOutput, num_top: int) -> dict:
        content = []
        for text, logprob, alternatives in self.token_logprobs(completion):
            top = sorted(alternatives.items(), key=lambda item: -item[1])[:num_top]
            content.append({"token": text, "logprob": logprob, "bytes": list(text.encode()),
                            "top_logprobs": [{"token": self.token_text(t), "logprob": clamp_logprob(lp),
                                              "bytes": list(self.token_text(t).encode())} for t, lp in top]})
        return {"content": content}

    def _choice_logprobs(self, request: ChatCompletionRequest, completion: CompletionOutput):
        return self._logprobs(completion, request.top_logprobs or 0) if request.logprobs else None

    def _message(self, mode: ToolMode, completion: CompletionOutput) -> tuple[dict, str | None]:
        """The choice's message and finish reason: thinking apart, tool calls read from the answer."""
        text = completion.text or ""
        reasoning = None
        if self.reasoning_parser is not None:
            reasoning, text = split_reasoning(self.reasoning_parser, text)
        content, calls = mode.calls(text)
        message: dict[str, Any] = {"role": ROLE, "content": content if content or not calls else None}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        finish_reason = completion.finish_reason
        if calls:
            message["tool_calls"] = [call.body() for call in calls]
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return message, finish_reason

    async def _complete(self, request: ChatCompletionRequest, mode: ToolMode, submission: Submission,
                        fields: dict) -> dict:
        outputs = await final_outputs(submission)
        output = outputs[0]
        choices = []
        for c in output.outputs:
            message, finish_reason = self._message(mode, c)
            choices.append({"index": c.index, "message": message, "logprobs": self._choice_logprobs(request, c),
                            "finish_reason": finish_reason, "stop_reason": c.stop_reason,
                            **(token_id_fields(output, c, True) if request.return_token_ids else {})})
        return {**fields, "choices": choices, "usage": usage([output])}

    def _stream(self, request: ChatCompletionRequest, mode: ToolMode, submission: Submission,
                fields: dict) -> AsyncIterator[bytes]:
        streams: dict[int, StreamedChoice] = {}

        def choice_of(delta: ChoiceDelta) -> dict | None:
            completion = delta.completion
            stream = streams.setdefault(delta.index, StreamedChoice(mode, self.reasoning_parser))
            finished = completion.finish_reason is not None
            message_delta = stream.delta(completion.text or "", finished)
            if not (message_delta or finished or completion.token_ids):
                return None  # nothing to say yet (text held back: a character, a tag, a call in the making)
            finish_reason = completion.finish_reason
            if finish_reason == "stop" and stream.called:
                finish_reason = "tool_calls"
            choice = {"index": delta.index, "delta": message_delta, "logprobs": self._choice_logprobs(request, completion),
                      "finish_reason": finish_reason, "stop_reason": completion.stop_reason}
            if request.return_token_ids:
                choice.update(token_id_fields(delta.output, completion, delta.is_first))
            return choice

        # The first chunk of every choice carries the role, before any token is ready.
        opening = [{"index": index, "delta": {"role": ROLE, "content": ""}, "logprobs": None, "finish_reason": None}
                   for index in range(request.n)]
        return sse_stream(submission, request.n, fields, request.include_usage_in_stream, choice_of, opening)
