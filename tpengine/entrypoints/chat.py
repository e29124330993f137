"""POST /v1/chat/completions: messages (and tools) through the chat template, whole responses or server-sent
events; a reasoning model's thinking split off (--reasoning-parser), tool calls forced by a grammar or read
from what the model wrote (tool_calls.py)."""
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse

from tpengine.entrypoints.async_engine import Submission
from tpengine.entrypoints.protocol import ChatCompletionRequest, NamedToolChoice
from tpengine.entrypoints.reasoning import ReasoningSplitter
from tpengine.entrypoints.serving import (ApiError, ChoiceDelta, OpenAIServing, cancel_on_disconnect, clamp_logprob,
                                          final_outputs, new_response_fields, sse_stream, token_id_fields, usage)
from tpengine.entrypoints.tool_calls import (AUTO_READERS, CallsReader, NamedCall, RequiredCalls, parameters_schema,
                                             required_schema)
from tpengine.errors import InvalidRequestError
from tpengine.multimodal.chat import has_image_parts, take_images
from tpengine.multimodal.images import checked_processor_kwargs
from tpengine.outputs import CompletionOutput
from tpengine.sampling_params import StructuredOutputsParams
from tpengine.thinking import thinking_open_after

ROLE = "assistant"


def template_messages(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as dicts, text parts joined (render_chat_text reads tool-call arguments as objects)."""
    return [m.template_dict() for m in request.messages]


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

    def reader(self) -> CallsReader:
        """A reader of one answer's content and calls."""
        if self.kind == "named":
            return NamedCall(self.function)
        if self.kind == "required":
            return RequiredCalls()
        if self.kind == "auto":
            return AUTO_READERS[self.parser](self.names, self.parallel)
        return CallsReader()


class ChoiceReader:
    """One choice's text read as it is written: the thinking apart (--reasoning-parser), the answer into content and
    tool calls. A whole completion is read as one final piece of text, so streamed and whole choices agree."""

    def __init__(self, mode: ToolMode, thinking_open: bool | None):
        """thinking_open: whether the prompt left the thinking open; None without a reasoning parser."""
        self.reasoning = None if thinking_open is None else ReasoningSplitter(thinking_open)
        self.answer = mode.reader()

    def delta(self, text: str, finished: bool) -> dict:
        """The message delta for the completion's new text (and its end)."""
        reasoning, answer = ("", text) if self.reasoning is None else self.reasoning.feed(text, final=finished)
        content, calls = self.answer.feed(answer, final=finished)
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta

    def finish_reason(self, finish_reason: str | None) -> str | None:
        # a call cut short keeps "length": the client learns its arguments are not whole
        return "tool_calls" if finish_reason == "stop" and self.answer.calls else finish_reason

    def message(self, text: str) -> dict:
        """The message of a whole completion's text."""
        delta = self.delta(text, finished=True)
        content, calls = self.answer.content, self.answer.calls
        message: dict[str, Any] = {"role": ROLE, "content": content if content or not calls else None}
        if self.reasoning is not None and self.reasoning.thinking:
            message["reasoning_content"] = delta.get("reasoning_content", "")
        if calls:
            message["tool_calls"] = [call.body() for call in calls]
        return message


@dataclasses.dataclass
class ChatRun:
    """A chat request submitted to the engine, and how its replies are read."""
    prompt: list[int]
    mode: ToolMode
    thinking_open: bool | None  # whether the prompt left the thinking open; None without a reasoning parser
    submission: Submission

    def reader(self) -> ChoiceReader:
        """A reader of one of its replies."""
        return ChoiceReader(self.mode, self.thinking_open)


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
        run = await self.start(request)
        if request.stream:
            fields = {**new_response_fields("chatcmpl", self.response_model(request.model)),
                      "object": "chat.completion.chunk"}
            return StreamingResponse(self._stream(request, run, fields), media_type="text/event-stream")
        fields = {**new_response_fields("chatcmpl", self.response_model(request.model)), "object": "chat.completion"}
        return await cancel_on_disconnect(raw_request, self._complete(request, run, fields))

    async def start(self, request: ChatCompletionRequest, by_step: bool = False) -> ChatRun:
        """Check the request, render its prompt and submit it: what /v1/chat/completions and /v1/messages share
        (by_step: its deltas one engine step at a time, for a consumer that counts tokens)."""
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
            try:
                tool_spec = mode.grammar(request)
            except ValueError as e:  # the tools' parameters over a structured-outputs limit
                raise self.invalid(e, request) from None
            spec = await self.checked_grammar(tool_spec, "tools", request)
        prompt, images = await self.render_prompt_and_images(request)
        max_tokens = self.max_tokens(request.max_completion_tokens or request.max_tokens, [prompt], request)
        # a chat reply: a reasoning model may open its thinking with its first token (tpengine/thinking.py)
        params = dataclasses.replace(self.sampling_params(request, max_tokens, request.num_logprobs, spec),
                                     may_open_thinking=True)
        thinking_open = (None if self.reasoning_parser is None
                         else thinking_open_after(prompt, *self.engine.engine.reasoning_tokens))
        engine_prompt = {"prompt_token_ids": prompt, "multi_modal_data": {"image": images}} if images else prompt
        return ChatRun(prompt, mode, thinking_open, await self.submit([engine_prompt], params, request, by_step))

    async def render(self, request: ChatCompletionRequest) -> dict:
        """POST /v1/chat/completions/render (vLLM's): the prompt's token ids through the chat template, generating
        nothing. vLLM's router asks for them to route a request by its tokens' prefix (cache_aware)."""
        self.check_model(request.model)
        return {"request_id": new_response_fields("chatcmpl", self.model_name)["id"],
                "model": self.response_model(request.model),
                "token_ids": await self.render_prompt(request)}

    async def render_prompt(self, request: ChatCompletionRequest) -> list[int]:
        return (await self.render_prompt_and_images(request))[0]

    async def render_prompt_and_images(self, request: ChatCompletionRequest) -> tuple[list[int], list]:
        """The prompt's token ids through the chat template, and the images its messages hold (read on the
        renderer's thread: a malformed one is this request's 400, naming it)."""
        tools = [tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools else None
        messages, images = template_messages(request), []
        try:
            if has_image_parts(messages) or request.mm_processor_kwargs is not None:
                engine = self.engine.engine
                if engine.images is None:
                    raise InvalidRequestError(f"this model ({self.model_name}) reads no images"
                                              f"{engine.text_only_reason}: image_url parts and mm_processor_kwargs "
                                              "need an image model (Qwen2.5-VL, Qwen3-VL, Gemma 3)", "messages")
                checked_processor_kwargs(request.mm_processor_kwargs)
                messages, images = await self.renderer.run(self._read_images, messages, request.mm_processor_kwargs)
            prompt = await self.renderer.render_chat(messages, request.add_generation_prompt,
                                                     request.chat_template_kwargs, tools, request.add_special_tokens,
                                                     self.engine.engine.images.expand_text if images else None)
            if images:  # each placeholder grown to its image's tokens, as the engine runs it (and counts it)
                prompt = (await self.renderer.run(self.engine.engine.images.place, prompt, images))[0]
        except ValueError as e:
            raise self.invalid(e, request) from None
        return prompt, images

    def _read_images(self, messages: list[dict[str, Any]],
                     processor_kwargs: dict | None) -> tuple[list[dict[str, Any]], list]:
        """(the renderer's thread) The messages' images decoded and through the image processor (within the
        request's min_pixels/max_pixels), so the engine thread only places them."""
        engine = self.engine.engine
        messages, images = take_images(messages, engine.config.allowed_local_media_path)
        return messages, engine.images.processor.process(images, processor_kwargs)

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

    async def _complete(self, request: ChatCompletionRequest, run: ChatRun, fields: dict) -> dict:
        outputs = await final_outputs(run.submission)
        output = outputs[0]
        choices = []
        for c in output.outputs:
            reader = run.reader()
            message = reader.message(c.text or "")
            choices.append({"index": c.index, "message": message, "logprobs": self._choice_logprobs(request, c),
                            "finish_reason": reader.finish_reason(c.finish_reason), "stop_reason": c.stop_reason,
                            **(token_id_fields(output, c, True) if request.return_token_ids else {})})
        return {**fields, "choices": choices, "usage": usage([output])}

    def _stream(self, request: ChatCompletionRequest, run: ChatRun, fields: dict) -> AsyncIterator[bytes]:
        readers: dict[int, ChoiceReader] = {}

        def choice_of(delta: ChoiceDelta) -> dict | None:
            completion = delta.completion
            if delta.index not in readers:
                readers[delta.index] = run.reader()
            reader = readers[delta.index]
            finished = completion.finish_reason is not None
            message_delta = reader.delta(completion.text or "", finished)
            if not (message_delta or finished or completion.token_ids):
                return None  # nothing to say yet (text held back: a character, a tag, a call's name in the making)
            choice = {"index": delta.index, "delta": message_delta, "logprobs": self._choice_logprobs(request, completion),
                      "finish_reason": reader.finish_reason(completion.finish_reason),
                      "stop_reason": completion.stop_reason}
            if request.return_token_ids:
                choice.update(token_id_fields(delta.output, completion, delta.is_first))
            return choice

        # The first chunk of every choice carries the role, before any token is ready.
        opening = [{"index": index, "delta": {"role": ROLE, "content": ""}, "logprobs": None, "finish_reason": None}
                   for index in range(request.n)]
        return sse_stream(run.submission, request.n, fields, request.include_usage_in_stream, choice_of, opening)
