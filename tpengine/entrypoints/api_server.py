"""The FastAPI app: routes, the API key, the body-size cap, and errors in OpenAI's shape (in Anthropic's on
/v1/messages)."""
import asyncio
import importlib.metadata
import logging
import secrets
import sys
from collections.abc import Callable
from contextlib import asynccontextmanager

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, PlainTextResponse, Response

from tpengine.entrypoints.async_engine import AsyncEngine, EngineDeadError
from tpengine.entrypoints.chat import OpenAIServingChat
from tpengine.entrypoints.completions import OpenAIServingCompletion
from tpengine.entrypoints.embeddings import OpenAIServingEmbedding
from tpengine.entrypoints.score import OpenAIServingScore
from tpengine.entrypoints.lora_modules import LoRAModulePath, ServedModels
from tpengine.entrypoints.messages import AnthropicServingMessages, MessagesPrompt, MessagesRequest, error_body
from tpengine.entrypoints.metrics import CONTENT_TYPE, Metrics
from tpengine.entrypoints.protocol import (FIELD_KINDS, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                          EmbeddingRequest, LoadLoRAAdapterRequest, RerankRequest, ScoreRequest,
                                          TokenizeChatRequest, UnloadLoRAAdapterRequest, tokenize_request_kind)
from tpengine.entrypoints.renderer import PromptRenderer
from tpengine.entrypoints.responses import ResponsesRequest
from tpengine.entrypoints.responses_serving import OpenAIServingResponses
from tpengine.entrypoints.serving import ApiError, engine_down
from tpengine.entrypoints.warmup import Readiness, front_end_parts, warm_up_front_end
from tpengine.long_lived import freeze_start_up_objects, thaw_start_up_objects

logger = logging.getLogger("tpengine")

# Far above any prompt max_model_len allows, far below what could hurt the server.
MAX_BODY_BYTES = 16 * 1024 * 1024
# A client has this long to send a whole request body: a slow one cannot hold a connection forever.
BODY_TIMEOUT_S = 60.0
# What --api-key guards: the routes that do work for a client (health, metrics and the version stay open).
KEYED_PATHS = ("/v1", "/tokenize", "/detokenize")
# Anthropic's Messages API: its errors in Anthropic's shape
ANTHROPIC_PATHS = ("/v1/messages",)
# what an unknown field's 400 says the endpoint takes
OPENAI_FIELDS = "OpenAI's fields and vLLM's sampling extensions"
ANTHROPIC_FIELDS = "the Messages API fields it lists"


def error_response(error: ApiError, close: bool = False, path: str = "") -> JSONResponse:
    # close: answered before the body was read to its end, so the connection cannot carry another request
    body = error_body(error) if path.startswith(ANTHROPIC_PATHS) else error.body()
    return JSONResponse(body, status_code=error.status, headers={"Connection": "close"} if close else None)


class Draining:
    """Set when the server stops accepting: a request still sending its body is answered 503 at once
    (instead of being cut off by uvicorn's deadline with a plain-text 500)."""

    def __init__(self):
        self._future: asyncio.Future | None = None
        self.is_set = False

    def future(self) -> asyncio.Future:
        if self._future is None:
            self._future = asyncio.get_running_loop().create_future()
            if self.is_set:
                self._future.set_result(None)
        return self._future

    def set(self) -> None:
        self.is_set = True
        if self._future is not None and not self._future.done():
            self._future.set_result(None)


def _bearer_token(authorization: bytes) -> bytes | None:
    """The token of an 'Authorization: Bearer TOKEN' header; the scheme is case-insensitive (RFC 7235)."""
    scheme, _, token = authorization.strip().partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else None


class RequestGate:
    """ASGI middleware in front of every route: the API key on KEYED_PATHS, the body-size cap (a body over it
    gets a 413 whether or not it says its length), the body deadline (408), and the drain at shutdown
    (503 for a body still arriving). Pure ASGI, so streams pass untouched."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, body_timeout_s: float, draining: Draining):
        self.app, self.max_body_bytes, self.body_timeout_s, self.draining = app, max_body_bytes, body_timeout_s, draining
        self.api_key = None if api_key is None else api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.api_key is not None and scope["path"].startswith(KEYED_PATHS):
            headers = dict(scope["headers"])
            # Anthropic's clients send the key as x-api-key
            token = _bearer_token(headers.get(b"authorization", b"")) or headers.get(b"x-api-key")
            if token is None or not secrets.compare_digest(token, self.api_key):
                error = ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY' (or "
                                      "'x-api-key: KEY')", "authentication_error", code="invalid_api_key")
                return await error_response(error, close=True, path=scope["path"])(scope, receive, send)
        body = await self._read_body(receive)
        if isinstance(body, ApiError):
            return await error_response(body, close=True, path=scope["path"])(scope, receive, send)
        if body is None:
            return  # the client went away
        replayed = False

        async def replay_body():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay_body, send)

    async def _read_body(self, receive) -> bytes | ApiError | None:
        """The whole body (it is small by the cap); an ApiError when it cannot be had; None if the client left."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        draining = self.draining.future()
        body, more_body = bytearray(), True
        while more_body:
            receiving = asyncio.ensure_future(receive())
            await asyncio.wait((receiving, draining), timeout=max(0.0, deadline - loop.time()),
                               return_when=asyncio.FIRST_COMPLETED)
            if not receiving.done():
                receiving.cancel()
                if draining.done():
                    return ApiError(503, "the server is shutting down; send the request again elsewhere or later",
                                    "service_unavailable", code="shutting_down")
                return ApiError(408, f"the request body did not arrive within {self.body_timeout_s:g} s",
                                code="request_timeout")
            message = receiving.result()
            if message["type"] != "http.request":
                return None
            body += message.get("body", b"")
            more_body = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                return ApiError(413, f"request body is larger than the server's limit of {self.max_body_bytes} "
                                     "bytes", code="request_too_large")
        return bytes(body)


def parse_request(model: type[BaseModel] | Callable[[dict], type[BaseModel]], body: bytes,
                  max_request_len: int, api: str = OPENAI_FIELDS) -> BaseModel:
    """A request body as `model` (or as the model that function of the decoded body picks), or an ApiError
    naming what is wrong. msgspec decodes the JSON (several times faster than json.loads on long token lists,
    and this runs on the event loop); the model's checks know the server's token limit, so a prompt that
    cannot fit is refused before its tokens are checked."""
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    except RecursionError:  # msgspec descends as deep as Python's recursion limit lets it
        raise ApiError(400, f"the body's JSON nests deeper than this server reads (about {sys.getrecursionlimit()} "
                            "levels)") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(data).__name__}")
    if not isinstance(model, type):
        model = model(data)
    try:
        return model.model_validate(data, context={"max_request_len": max_request_len})
    except ValidationError as e:
        raise validation_error(e.errors(include_input=False), api) from None


def validation_error(problems: list[dict], api: str = OPENAI_FIELDS) -> ApiError:
    """pydantic's complaints as one 400 naming each field; a union's failed alternatives read as one problem
    (a length limit, if one of them met it, else what the field takes)."""
    by_field: dict[str, list[dict]] = {}
    for problem in problems:
        loc = problem["loc"][1:] if problem["loc"][:1] == ("body",) else problem["loc"]  # FastAPI's start with it
        union_at = next((i for i, part in enumerate(loc) if _is_union_tag(part)), len(loc))
        by_field.setdefault(".".join(map(str, loc[:union_at])), []).append(problem)
    messages = []
    for field, group in by_field.items():
        problem = next((p for p in group if p["type"] == "too_long"), group[0])
        if problem["type"] == "json_invalid":
            message = f"the body is not valid JSON: {problem.get('ctx', {}).get('error', problem['msg'])}"
        elif problem["type"] == "extra_forbidden":
            message = f"unknown field: this server takes {api} (see its README)"
        elif problem["type"] != "too_long" and len(group) > 1 and field.rsplit(".", 1)[-1] in FIELD_KINDS:
            message = f"must be {FIELD_KINDS[field.rsplit('.', 1)[-1]]}"
        else:
            message = problem["msg"].removeprefix("Value error, ")
        messages.append(f"{field}: {message}" if field and problem["type"] != "json_invalid" else message)
    first_field = next(iter(by_field), "")
    return ApiError(400, "; ".join(messages) or "invalid request", param=first_field or None)


def _is_union_tag(part) -> bool:
    # pydantic names a union's alternatives in loc by their type ("str", "list[str]", "constrained-int", ...)
    return isinstance(part, str) and any(c in part for c in "[]-") or part in ("str", "int", "float", "bool", "none")


def tpengine_version() -> str:
    try:
        return importlib.metadata.version("tpengine")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def build_app(engine: AsyncEngine, *, renderer: PromptRenderer, tokenizer, model_name: str, model_path: str,
              max_model_len: int, max_request_len: int, metrics: Metrics, api_key: str | None = None,
              max_body_bytes: int = MAX_BODY_BYTES, body_timeout_s: float = BODY_TIMEOUT_S,
              draining: Draining | None = None, tool_parser: str | None = None, enable_auto_tool_choice: bool = False,
              reasoning_parser: str | None = None, warm_up: bool = False, served_models: ServedModels | None = None,
              allow_runtime_lora_updating: bool = False) -> FastAPI:
    """The app; `draining`, once set (by the server's shutdown), answers bodies still arriving with a 503. With
    warm_up, /health answers 503 until what the first requests would pay outside the engine is paid (warmup.py).
    served_models: model_name's LoRA adapters (default none); allow_runtime_lora_updating adds vLLM's routes that
    load and unload them."""
    models = served_models or ServedModels(model_name, model_path)
    completions = OpenAIServingCompletion(engine, renderer, tokenizer, models, max_request_len)
    chat = OpenAIServingChat(engine, renderer, tokenizer, models, max_request_len, tool_parser=tool_parser,
                             enable_auto_tool_choice=enable_auto_tool_choice, reasoning_parser=reasoning_parser)

    readiness = Readiness()

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        warming = None
        parts = front_end_parts(engine, renderer) if warm_up else []
        if parts:
            readiness.preparing = ", ".join(parts)
            logger.info("warming up: %s", readiness.preparing)
            warming = asyncio.create_task(warm_up_front_end(engine, renderer, readiness))
        else:  # one engine a process: what start-up made lives as long as the server (long_lived.py)
            freeze_start_up_objects()
        yield
        if warming is not None:
            warming.cancel()
        engine.stop()
        renderer.close()
        thaw_start_up_objects()

    draining = draining or Draining()
    app = FastAPI(title="tpengine", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(RequestGate, api_key=api_key, max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s,
                       draining=draining)
    _add_error_handlers(app)
    _add_status_routes(app, engine, draining, readiness, metrics, models, max_model_len)
    if allow_runtime_lora_updating:  # else they are not routes at all (a 404), as in vLLM
        _add_lora_routes(app, engine, models, max_request_len)
    _add_generation_routes(app, completions, chat, max_request_len)
    _add_embedding_routes(app, OpenAIServingEmbedding(engine, renderer, tokenizer, models, max_request_len),
                          max_request_len)
    _add_score_routes(app, OpenAIServingScore(engine, renderer, tokenizer, models, max_request_len), max_request_len)
    _add_responses_routes(app, OpenAIServingResponses(chat, max_request_len), max_request_len)
    _add_messages_routes(app, AnthropicServingMessages(chat, max_request_len), max_request_len)
    _add_tokenizer_routes(app, engine, renderer, completions, chat, max_model_len, max_request_len)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape; an unexpected one a 500 whose traceback stays in the log."""
    @app.exception_handler(ApiError)
    async def api_error(request, error: ApiError):
        return error_response(error, path=request.url.path)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request, error: RequestValidationError):
        return error_response(validation_error(error.errors()), path=request.url.path)

    @app.exception_handler(HTTPException)
    async def http_error(request, error: HTTPException):
        return error_response(ApiError(error.status_code, str(error.detail), "invalid_request_error"),
                              path=request.url.path)

    @app.exception_handler(Exception)
    async def internal_error(request, error: Exception):
        logger.exception("internal error answering %s", request.url.path)
        return error_response(ApiError(500, "internal server error", "internal_error"), path=request.url.path)


def _add_status_routes(app: FastAPI, engine: AsyncEngine, draining: Draining, readiness: Readiness,
                       metrics: Metrics, models: ServedModels, max_model_len: int) -> None:
    """/health, /v1/models, /version and /metrics."""
    @app.get("/health")
    async def health():
        # a router sends no new request to a server that is draining or whose engine is dead
        if draining.is_set:
            return error_response(ApiError(503, "the server is shutting down", "service_unavailable",
                                           code="shutting_down"))
        if not engine.is_healthy:
            return error_response(ApiError(503, f"the engine is not running: {engine.error}", "service_unavailable"))
        # and none to one still warming up: its first requests would stall on what it prepares
        if readiness.preparing is not None:
            return error_response(ApiError(503, f"the server is warming up: {readiness.preparing}",
                                           "service_unavailable", code="warming_up"))
        return Response(status_code=200)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": models.cards(max_model_len)}

    @app.get("/v1/models/{model_id:path}")  # :path, as a served name may hold slashes ("org/model")
    async def retrieve_model(model_id: str):
        return models.card(model_id, max_model_len)

    @app.get("/version")
    async def version():
        return {"version": tpengine_version()}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)


def _add_lora_routes(app: FastAPI, engine: AsyncEngine, models: ServedModels, max_request_len: int) -> None:
    """vLLM's runtime adapter updates: POST /v1/load_lora_adapter and /v1/unload_lora_adapter, answered in its
    words."""
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(raw_request: Request):
        request = parse_request(LoadLoRAAdapterRequest, await raw_request.body(), max_request_len)
        try:
            lora_request = models.new_lora_request(LoRAModulePath(request.lora_name, request.lora_path))
            await engine.add_lora(lora_request)  # its weights checked against the model, before anyone uses it
            models.register(lora_request)
        except ValueError as e:  # the engine's own check names no field: its adapter's
            raise ApiError(400, str(e), param=getattr(e, "param", None) or "lora_path") from None
        except EngineDeadError as e:
            raise engine_down(e) from None
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(raw_request: Request):
        request = parse_request(UnloadLoRAAdapterRequest, await raw_request.body(), max_request_len)
        lora_request = models.remove(request.lora_name, request.lora_int_id)
        try:
            await engine.remove_lora(lora_request.lora_int_id)  # its slot frees as its running requests finish
        except EngineDeadError as e:
            raise engine_down(e) from None
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' removed successfully.")


def _add_generation_routes(app: FastAPI, completions: OpenAIServingCompletion, chat: OpenAIServingChat,
                           max_request_len: int) -> None:
    """/v1/completions and /v1/chat/completions, and vLLM's render endpoints of both."""
    @app.post("/v1/completions")
    async def create_completion(raw_request: Request):
        request = parse_request(CompletionRequest, await raw_request.body(), max_request_len)
        return await completions.create(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(raw_request: Request):
        request = parse_request(ChatCompletionRequest, await raw_request.body(), max_request_len)
        return await chat.create(request, raw_request)

    # vLLM's render endpoints: vllm-router's cache_aware policy routes by the token ids they return
    @app.post("/v1/completions/render")
    async def render_completion(raw_request: Request):
        return await completions.render(parse_request(CompletionRequest, await raw_request.body(), max_request_len))

    @app.post("/v1/chat/completions/render")
    async def render_chat_completion(raw_request: Request):
        return await chat.render(parse_request(ChatCompletionRequest, await raw_request.body(), max_request_len))


def _add_embedding_routes(app: FastAPI, embeddings: OpenAIServingEmbedding, max_request_len: int) -> None:
    """POST /v1/embeddings: any engine embeds (a generating one in the same steps as its completions)."""
    @app.post("/v1/embeddings")
    async def create_embedding(raw_request: Request):
        request = parse_request(EmbeddingRequest, await raw_request.body(), max_request_len)
        return await embeddings.create(request, raw_request)


def _add_score_routes(app: FastAPI, scoring: OpenAIServingScore, max_request_len: int) -> None:
    """vLLM's POST /score and /rerank (Jina's and Cohere's shape, under /v1 and /v2 too): any pooling-capable engine
    scores, a classifier by its head, an embedding model by cosine similarity."""
    async def score(raw_request: Request):
        return await scoring.create_score(parse_request(ScoreRequest, await raw_request.body(), max_request_len),
                                          raw_request)

    async def rerank(raw_request: Request):
        return await scoring.create_rerank(parse_request(RerankRequest, await raw_request.body(), max_request_len),
                                           raw_request)

    for path in ("/score", "/v1/score"):
        app.add_api_route(path, score, methods=["POST"])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.add_api_route(path, rerank, methods=["POST"])


def _add_responses_routes(app: FastAPI, responses: OpenAIServingResponses, max_request_len: int) -> None:
    """OpenAI's Responses API: POST /v1/responses, and GET/DELETE of a stored response."""
    @app.post("/v1/responses")
    async def create_response(raw_request: Request):
        request = parse_request(ResponsesRequest, await raw_request.body(), max_request_len)
        return await responses.create(request, raw_request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, raw_request: Request):
        _no_query(raw_request)
        return responses.retrieve(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, raw_request: Request):
        _no_query(raw_request)
        return responses.delete(response_id)


def _no_query(request: Request) -> None:
    """A stored response comes back whole: stream, starting_after and include ask for what is not done."""
    for name in request.query_params:
        raise ApiError(400, f"the query parameter {name!r:.60} is not supported: a stored response comes back "
                            "whole", param=name)


def _add_messages_routes(app: FastAPI, messages: AnthropicServingMessages, max_request_len: int) -> None:
    """Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens."""
    @app.post("/v1/messages")
    async def create_message(raw_request: Request):
        request = parse_request(MessagesRequest, await raw_request.body(), max_request_len, ANTHROPIC_FIELDS)
        return await messages.create(request, raw_request)

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(raw_request: Request):
        return await messages.count_tokens(parse_request(MessagesPrompt, await raw_request.body(), max_request_len,
                                                         ANTHROPIC_FIELDS))


def _add_tokenizer_routes(app: FastAPI, engine: AsyncEngine, renderer: PromptRenderer,
                          completions: OpenAIServingCompletion, chat: OpenAIServingChat, max_model_len: int,
                          max_request_len: int) -> None:
    """vLLM's tokenizer endpoints: the token ids /v1/completions or /v1/chat/completions would run, and the text of
    ids."""
    @app.post("/tokenize")
    async def tokenize(raw_request: Request):
        request = parse_request(tokenize_request_kind, await raw_request.body(), max_request_len)
        if isinstance(request, TokenizeChatRequest):
            tokens = (await chat.render(request))["token_ids"]
        else:
            tokens = (await completions.render(request))[0]["token_ids"]
        token_strs = await renderer.run(renderer.tokenizer.convert_ids_to_tokens, tokens) \
            if request.return_token_strs else None
        return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens, "token_strs": token_strs}

    @app.post("/detokenize")
    async def detokenize(raw_request: Request):
        request = parse_request(DetokenizeRequest, await raw_request.body(), max_request_len)
        completions.check_model(request.model)
        if renderer.tokenizer is None:
            raise ApiError(400, "this model folder has no tokenizer, so token ids have no text here", param="tokens")
        vocab_size = engine.engine.vocab_size
        if request.tokens and max(request.tokens) >= vocab_size:
            raise ApiError(400, f"token id {max(request.tokens)} is outside the vocabulary [0, {vocab_size})",
                           param="tokens")
        return {"prompt": await renderer.run(renderer.tokenizer.decode, request.tokens)}
