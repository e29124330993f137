"""POST /v1/chat/completions: messages through the chat template, whole responses or server-sent events."""
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import StreamingResponse

from tpengine.entrypoints.async_engine import Submission
from tpengine.entrypoints.protocol import ChatCompletionRequest
from tpengine.entrypoints.serving import (ChoiceDelta, OpenAIServing, cancel_on_disconnect, clamp_logprob,
                                          final_outputs, new_response_fields, sse_stream, token_id_fields,
                                          usage)
from tpengine.outputs import CompletionOutput

ROLE = "assistant"


class OpenAIServingChat(OpenAIServing):
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
        try:
            prompt = await self.renderer.render_chat([m.template_dict() for m in request.messages],
                                                     request.add_generation_prompt, request.chat_template_kwargs)
        except ValueError as e:
            raise self.invalid(e, request) from None
        max_tokens = self.max_tokens(request.max_completion_tokens or request.max_tokens, [prompt], request)
        params = self.sampling_params(request, max_tokens, request.num_logprobs)
        submission = await self.submit([prompt], params, request)
        if request.stream:
            fields = {**new_response_fields("chatcmpl", self.model_name), "object": "chat.completion.chunk"}
            return StreamingResponse(self._stream(request, submission, fields), media_type="text/event-stream")
        fields = {**new_response_fields("chatcmpl", self.model_name), "object": "chat.completion"}
        return await cancel_on_disconnect(raw_request, self._complete(request, submission, fields))

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

    async def _complete(self, request: ChatCompletionRequest, submission: Submission, fields: dict) -> dict:
        outputs = await final_outputs(submission)
        output = outputs[0]
        choices = [{"index": c.index, "message": {"role": ROLE, "content": c.text or ""},
                    "logprobs": self._choice_logprobs(request, c),
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                    **(token_id_fields(output, c, True) if request.return_token_ids else {})}
                   for c in output.outputs]
        return {**fields, "choices": choices, "usage": usage([output])}

    def _stream(self, request: ChatCompletionRequest, submission: Submission, fields: dict) -> AsyncIterator[bytes]:
        def choice_of(delta: ChoiceDelta) -> dict:
            completion = delta.completion
            choice = {"index": delta.index, "delta": {"content": completion.text} if completion.text else {},
                      "logprobs": self._choice_logprobs(request, completion),
                      "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}
            if request.return_token_ids:
                choice.update(token_id_fields(delta.output, completion, delta.is_first))
            return choice

        # The first chunk of every choice carries the role, before any token is ready.
        opening = [{"index": index, "delta": {"role": ROLE, "content": ""}, "logprobs": None, "finish_reason": None}
                   for index in range(request.n)]
        return sse_stream(submission, request.n, fields, request.include_usage_in_stream, choice_of, opening)
