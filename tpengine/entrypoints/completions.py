"""POST /v1/completions: prompts as text or token ids, whole responses or server-sent events."""
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import StreamingResponse

from tpengine.entrypoints.async_engine import Submission
from tpengine.entrypoints.protocol import CompletionRequest
from tpengine.entrypoints.serving import (ApiError, ChoiceDelta, OpenAIServing, cancel_on_disconnect, clamp_logprob,
                                          final_outputs, new_response_fields, sse_stream, token_id_fields,
                                          usage)
from tpengine.outputs import CompletionOutput, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, request: CompletionRequest, raw_request: Request):
        self.check_model(request.model)
        spec = await self.request_grammar(request)
        prompts = await self._encode(request)
        max_tokens = self.max_tokens(request.max_tokens, prompts, request)
        params = self.sampling_params(request, max_tokens, request.logprobs, spec)
        submission = await self.submit(prompts, params, request)
        fields = {**new_response_fields("cmpl", self.response_model(request.model)), "object": "text_completion"}
        if request.stream:
            return StreamingResponse(self._stream(request, submission, fields), media_type="text/event-stream")
        return await cancel_on_disconnect(raw_request, self._complete(request, submission, fields))

    def request_field(self, param: str | None, request: CompletionRequest) -> str | None:
        return "echo" if param == "prompt_logprobs" else param  # echo is what asks for the prompt's logprobs

    async def render(self, request: CompletionRequest) -> list[dict]:
        """POST /v1/completions/render (vLLM's): each prompt's token ids, generating nothing. vLLM's router asks
        for them to route a request by its tokens' prefix (cache_aware); it routes blind without them."""
        self.check_model(request.model)
        request_id = new_response_fields("cmpl", self.model_name)["id"]
        return [{"request_id": f"{request_id}-{i}", "model": self.response_model(request.model), "token_ids": token_ids}
                for i, token_ids in enumerate(await self._encode(request))]

    async def _encode(self, request: CompletionRequest) -> list[list[int]]:
        """Every prompt's token ids; text prompts are tokenized together, off the event loop."""
        prompts = request.prompts
        texts = [prompt for prompt in prompts if isinstance(prompt, str)]
        if not texts:
            return prompts
        if self.tokenizer is None:
            raise ApiError(400, "this model folder has no tokenizer: send prompts as token ids", param="prompt")
        if not all(texts):
            raise ApiError(400, "prompt is empty: it needs at least one token", param="prompt")
        try:
            encoded = iter(await self.renderer.encode(texts, add_special_tokens=request.add_special_tokens))
        except ValueError as e:
            raise self.invalid(e, request) from None
        return [next(encoded) if isinstance(prompt, str) else prompt for prompt in prompts]

    def _prompt_text(self, request: CompletionRequest, index: int, output: RequestOutput) -> str:
        """What echo puts first: the prompt as sent, or its token ids decoded."""
        prompt = request.prompts[index]
        if isinstance(prompt, str):
            return prompt
        return "" if self.tokenizer is None else self.tokenizer.decode(output.prompt_token_ids)

    def _choice_logprobs(self, request: CompletionRequest, output: RequestOutput, completion: CompletionOutput,
                         with_prompt: bool, text_offset: int) -> dict | None:
        """A choice's logprobs (None unless asked): its completion's tokens, after the prompt's where echo puts the
        prompt in front (as vLLM's: the prompt's first token has null ones, nothing before it scores it)."""
        if request.logprobs is None:
            return None
        if not (request.echo and with_prompt):
            return self._logprobs(completion.token_ids, completion.logprobs, text_offset)
        assert output.prompt_logprobs is not None, "echo with logprobs asks the engine for the prompt's"
        return self._logprobs(output.prompt_token_ids + completion.token_ids,
                              output.prompt_logprobs + completion.logprobs, text_offset)

    def _logprobs(self, token_ids: list[int], entries: list[dict[int, float] | None], text_offset: int) -> dict:
        """OpenAI's legacy logprobs of tokens, each with its {alternative id: logprob} entry (None: unscored)."""
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for token_id, alternatives in zip(token_ids, entries):
            text = self.token_text(token_id)
            tokens.append(text)
            offsets.append(text_offset)
            text_offset += len(text)
            if alternatives is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(clamp_logprob(alternatives[token_id]))
            # ascending, so where two tokens read the same (partial UTF-8) the likelier one's value stays
            top_logprobs.append({self.token_text(t): clamp_logprob(lp)
                                 for t, lp in sorted(alternatives.items(), key=lambda item: item[1])})
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}

    async def _complete(self, request: CompletionRequest, submission: Submission, fields: dict) -> dict:
        outputs = await final_outputs(submission)
        choices = []
        for prompt_index, output in sorted(outputs.items()):
            prefix = self._prompt_text(request, prompt_index, output) if request.echo else ""
            for completion in output.outputs:
                choices.append({
                    "index": prompt_index * request.n + completion.index,
                    "text": prefix + (completion.text or ""),
                    "logprobs": self._choice_logprobs(request, output, completion, True, 0),
                    "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason,
                    **(token_id_fields(output, completion, True) if request.return_token_ids else {})})
        return {**fields, "choices": choices, "usage": usage(outputs.values())}

    def _stream(self, request: CompletionRequest, submission: Submission, fields: dict) -> AsyncIterator[bytes]:
        text_offsets: dict[int, int] = {}  # choice index -> characters streamed, for logprobs' text_offset

        def choice_of(delta: ChoiceDelta) -> dict:
            completion = delta.completion
            text = completion.text or ""
            if delta.is_first and request.echo:
                text = self._prompt_text(request, delta.index // request.n, delta.output) + text
            offset = text_offsets.get(delta.index, 0)
            text_offsets[delta.index] = offset + len(text)
            choice = {"index": delta.index, "text": text,
                      "logprobs": self._choice_logprobs(request, delta.output, completion, delta.is_first, offset),
                      "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}
            if request.return_token_ids:
                choice.update(token_id_fields(delta.output, completion, delta.is_first))
            return choice

        return sse_stream(submission, request.n, fields, request.include_usage_in_stream, choice_of)
