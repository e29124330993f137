"""What /v1/completions and /v1/chat/completions share: the model check, limits, errors in OpenAI's
shape, submitting to the engine, and turning cumulative outputs into per-choice deltas."""
import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from tpengine.entrypoints.api_error import ApiError
from tpengine.entrypoints.async_engine import AsyncEngine, EngineDeadError, Submission
from tpengine.entrypoints.lora_modules import ServedModels
from tpengine.entrypoints.protocol import SamplingRequest
from tpengine.entrypoints.renderer import PromptRenderer
from tpengine.errors import InvalidRequestError
from tpengine.outputs import NO_TOKEN, NO_TOKEN_MESSAGE, CompletionOutput, EmbeddingRequestOutput, RequestOutput
from tpengine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

SSE_DONE = b"data: [DONE]\n\n"
# JSON has no -inf: a token the model rules out gets this log-probability, as vLLM reports it
MIN_LOGPROB = -9999.0


def engine_down(error: BaseException) -> ApiError:
    return ApiError(503, str(error), "service_unavailable", code="engine_unavailable")


def no_token_sampled() -> ApiError:
    """A completion ended without a token to sample (finish_reason NO_TOKEN): the server's fault, said as such."""
    return ApiError(500, NO_TOKEN_MESSAGE, "internal_server_error", code="no_token_sampled")


def sse(payload: dict) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


def clamp_logprob(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, renderer: PromptRenderer, tokenizer, models: ServedModels,
                 max_request_len: int):
        self.engine = engine
        self.renderer = renderer    # prompts to token ids, off the event loop
        self.tokenizer = tokenizer  # the event loop's own instance (token texts); the engine thread has its own
        self.models = models        # the served model's name and its LoRA adapters'
        self.model_name = models.base_model_name
        self.max_request_len = max_request_len  # prompt + output: max_model_len, or less if the cache is smaller
        self._token_texts: dict[int, str] = {}

    def check_model(self, name: str | None) -> None:
        """A 404 unless name is the served model's, an adapter's, or None."""
        self.models.lora_request(name)

    def response_model(self, name: str | None) -> str:
        """What a response says it ran: the adapter or model its (checked) request named, as vLLM answers."""
        return name or self.model_name

    def request_field(self, param: str | None, request: SamplingRequest) -> str | None:
        """The request's field for an input the engine names (SamplingParams' and the prompt's names)."""
        return param

    def invalid(self, error: ValueError, request: SamplingRequest) -> ApiError:
        """A 400 for what the engine, SamplingParams or the renderer refused, naming the request's field."""
        return ApiError(400, str(error), param=self.request_field(getattr(error, "param", None), request))

    def max_tokens(self, requested: int | None, prompts: list[list[int]], request: SamplingRequest) -> int:
        """requested, or what the longest prompt leaves of the context when the client set no limit."""
        if requested is not None:
            return requested
        longest = max(len(prompt) for prompt in prompts)
        if longest >= self.max_request_len:
            raise self.invalid(InvalidRequestError(
                f"prompt has {longest} tokens, which leaves no room to generate within the server's limit of "
                f"{self.max_request_len} tokens per request", "prompt"), request)
        return self.max_request_len - longest

    def sampling_params(self, request: SamplingRequest, max_tokens: int, logprobs: int | None,
                        structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        try:
            return request.sampling_params(max_tokens, logprobs,
                                           RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY,
                                           structured_outputs)
        except ValueError as e:  # SamplingParams names the bad value and its limit
            raise self.invalid(e, request) from None

    async def checked_grammar(self, spec: StructuredOutputsParams | None, param: str | None,
                              request: SamplingRequest) -> StructuredOutputsParams | None:
        """spec, once its grammar is compiled (on the compiler's threads: neither the event loop, the renderer nor
        other compiles wait for it); a 400 naming param (the field that asked for it) if it is rejected or does not
        compile in time."""
        if spec is None:
            return None
        try:
            compiler = self.engine.engine.grammar_compiler
            compiling = asyncio.wrap_future(compiler.compile(spec, param))
            # shielded: a timeout here leaves the compile to finish (and be cached) for whoever shares it
            await asyncio.wait_for(asyncio.shield(compiling), compiler.compile_timeout_s)
        except asyncio.TimeoutError:
            raise self.invalid(compiler.too_slow(spec, param), request) from None
        except ValueError as e:
            raise self.invalid(e, request) from None
        return spec

    async def request_grammar(self, request: SamplingRequest) -> StructuredOutputsParams | None:
        """The grammar the request's response_format or structured_outputs asks for, checked."""
        try:
            spec, param = request.structured_outputs_params()
        except ValueError as e:
            raise self.invalid(e, request) from None
        return await self.checked_grammar(spec, param, request)

    async def submit(self, prompts: list[list[int]], params: SamplingParams, request: SamplingRequest,
                     by_step: bool = False) -> Submission:
        """Queue the prompts, on the LoRA adapter the request's model names, if any; a streamed request's outputs
        come as deltas (only what each step added; by_step: one step's at a time)."""
        try:
            return await self.engine.submit(prompts, params, request.stream, self.models.lora_request(request.model),
                                            by_step)
        except ValueError as e:
            raise self.invalid(e, request) from None
        except EngineDeadError as e:
            raise engine_down(e) from None

    def token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = "" if self.tokenizer is None else self.tokenizer.decode([token_id])
            self._token_texts[token_id] = text
        return text

    def token_logprobs(self, completion: CompletionOutput) -> Iterable[tuple[str, float, dict]]:
        """(token text, its log-probability, {alternative id: log-probability}) per token of the completion."""
        for token_id, alternatives in zip(completion.token_ids, completion.logprobs):
            yield self.token_text(token_id), clamp_logprob(alternatives[token_id]), alternatives


def token_id_fields(output: RequestOutput, completion: CompletionOutput, with_prompt: bool) -> dict:
    """return_token_ids: the completion's token ids (a delta's: the new ones), and the prompt's where asked."""
    fields = {"token_ids": completion.token_ids}
    if with_prompt:
        fields["prompt_token_ids"] = output.prompt_token_ids
    return fields


def new_response_fields(kind: str, model_name: str) -> dict:
    return {"id": f"{kind}-{uuid.uuid4().hex}", "created": int(time.time()), "model": model_name}


def usage(outputs: Iterable[RequestOutput]) -> dict:
    """The usage field of requests' final cumulative outputs."""
    outputs = list(outputs)
    return usage_of(sum(len(output.prompt_token_ids) for output in outputs),
                    sum(len(c.token_ids) for output in outputs for c in output.outputs),
                    sum(output.num_cached_tokens for output in outputs))


def usage_of(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


async def final_outputs(submission: Submission) -> dict[int, RequestOutput | EmbeddingRequestOutput]:
    """Wait for every prompt of a non-streamed request; aborts it if the wait is cancelled."""
    latest: dict[int, RequestOutput] = {}
    try:
        async for outputs in submission:
            latest.update(outputs)
    except EngineDeadError as e:
        raise engine_down(e) from None
    finally:
        submission.abort()
    if any(c.finish_reason == NO_TOKEN for output in latest.values() if isinstance(output, RequestOutput)
           for c in output.outputs):  # an embedding's output has no completions
        raise no_token_sampled()
    return latest


@dataclass
class ChoiceDelta:
    index: int                 # prompt index * n + completion index, as OpenAI numbers choices
    output: RequestOutput      # a delta output: its completions hold only what is new
    completion: CompletionOutput
    is_first: bool


class StreamUsage:
    """Token counts summed over a stream's delta outputs, for its last chunk's usage."""

    def __init__(self):
        self.prompts: dict[int, RequestOutput] = {}  # prompt index -> an output of it (prompt counts)
        self.completion_tokens = 0

    def add(self, prompt_index: int, output: RequestOutput) -> None:
        self.prompts[prompt_index] = output
        self.completion_tokens += sum(len(c.token_ids) for c in output.outputs)

    def field(self) -> dict:
        outputs = self.prompts.values()
        return usage_of(sum(len(o.prompt_token_ids) for o in outputs), self.completion_tokens,
                        sum(o.num_cached_tokens for o in outputs))


async def choice_deltas(submission: Submission, n: int, counts: StreamUsage) -> AsyncIterator[ChoiceDelta]:
    """Per choice, what each step added (the engine streams delta outputs); counts sums the tokens."""
    started: set[int] = set()
    async for outputs in submission:
        for prompt_index, output in sorted(outputs.items()):
            counts.add(prompt_index, output)
            for completion in output.outputs:
                if completion.finish_reason == NO_TOKEN:
                    raise no_token_sampled()
                index = prompt_index * n + completion.index
                is_first = index not in started
                started.add(index)
                yield ChoiceDelta(index, output, completion, is_first)


async def sse_stream(submission: Submission, n: int, fields: dict, include_usage: bool,
                     choice_of: Callable[[ChoiceDelta], dict | None], opening: Iterable[dict] = ()) -> AsyncIterator[bytes]:
    """Server-sent events: the opening choices, one chunk per choice delta, the usage if asked, [DONE]."""
    counts = StreamUsage()
    usage_field = {"usage": None} if include_usage else {}
    try:
        for choice in opening:
            yield sse({**fields, "choices": [choice], **usage_field})
        async for delta in choice_deltas(submission, n, counts):
            choice = choice_of(delta)
            if choice is not None:  # None: nothing to send for this delta yet
                yield sse({**fields, "choices": [choice], **usage_field})
        if include_usage:
            yield sse({**fields, "choices": [], "usage": counts.field()})
    except EngineDeadError as e:
        yield sse(engine_down(e).body())
    except ApiError as e:
        yield sse(e.body())
    finally:
        submission.abort()  # a no-op once finished; else the client went away
    yield SSE_DONE


async def cancel_on_disconnect(request: Request, work: Awaitable):
    """Run work (a non-streamed response) unless the client goes away first: then cancel it, which
    aborts its request in the engine."""
    task = asyncio.ensure_future(work)

    async def wait_for_disconnect():
        # The body is already read: the next message this connection gets is its end.
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(wait_for_disconnect())
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()  # the client is gone, or this handler itself is being cancelled
    try:
        return await task
    except asyncio.CancelledError:
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it
