"""The FastAPI app: routes, the API key, the body-size cap, and errors in OpenAI's shape."""
import logging
import secrets
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from tpengine.entrypoints.async_engine import AsyncEngine
from tpengine.entrypoints.chat import OpenAIServingChat
from tpengine.entrypoints.completions import OpenAIServingCompletion
from tpengine.entrypoints.metrics import CONTENT_TYPE, Metrics
from tpengine.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from tpengine.entrypoints.serving import ApiError

logger = logging.getLogger("tpengine")

# Far above any prompt max_model_len allows, far below what could hurt the server.
MAX_BODY_BYTES = 16 * 1024 * 1024


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


class RequestGate:
    """ASGI middleware in front of every route: the API key on /v1, and the body-size cap (a body
    over it gets a 413 whether or not it says its length). Pure ASGI, so streams pass untouched."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.max_body_bytes = app, max_body_bytes
        self.authorization = None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.authorization is not None and scope["path"].startswith("/v1"):
            if not secrets.compare_digest(headers.get(b"authorization", b""), self.authorization):
                error = ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                                 "authentication_error", code="invalid_api_key")
                return await error_response(error)(scope, receive, send)
        # Read the whole body here (it is small by this cap), then hand it on.
        body, more_body = bytearray(), True
        while more_body:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            body += message.get("body", b"")
            more_body = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                error = ApiError(413, f"request body is larger than the server's limit of {self.max_body_bytes} "
                                      "bytes", code="request_too_large")
                return await error_response(error)(scope, receive, send)
        replayed = False

        async def replay_body():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay_body, send)


def validation_error(problems: list[dict]) -> ApiError:
    """pydantic's complaints as one 400 naming each field."""
    messages = []
    for problem in problems:
        field = ".".join(str(part) for part in problem["loc"][1:])  # loc starts with "body"
        if problem["type"] == "json_invalid":
            messages.append(f"the body is not valid JSON: {problem.get('ctx', {}).get('error', problem['msg'])}")
        else:
            message = problem["msg"].removeprefix("Value error, ")
            messages.append(f"{field}: {message}" if field else message)
    first = problems[0] if problems else None
    param = None if first is None or first["type"] == "json_invalid" else ".".join(map(str, first["loc"][1:]))
    return ApiError(400, "; ".join(messages) or "invalid request", param=param or None)


def build_app(engine: AsyncEngine, *, tokenizer, model_name: str, model_path: str, max_model_len: int,
              max_request_len: int, metrics: Metrics, api_key: str | None = None, chat_template: str | None = None,
              max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    completions = OpenAIServingCompletion(engine, tokenizer, model_name, max_request_len)
    chat = OpenAIServingChat(engine, tokenizer, model_name, max_request_len, chat_template=chat_template)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="tpengine", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(RequestGate, api_key=api_key, max_body_bytes=max_body_bytes)

    @app.exception_handler(ApiError)
    async def api_error(request, error: ApiError):
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request, error: RequestValidationError):
        return error_response(validation_error(error.errors()))

    @app.exception_handler(HTTPException)
    async def http_error(request, error: HTTPException):
        return error_response(ApiError(error.status_code, str(error.detail), "invalid_request_error"))

    @app.exception_handler(Exception)
    async def internal_error(request, error: Exception):
        logger.exception("internal error answering %s", request.url.path)  # the traceback stays in the log
        return error_response(ApiError(500, "internal server error", "internal_error"))

    @app.get("/health")
    async def health():
        if engine.is_healthy:
            return Response(status_code=200)
        return error_response(ApiError(503, f"the engine is not running: {engine.error}", "service_unavailable"))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "tpengine", "root": model_path,
                                            "max_model_len": max_model_len}]}

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request):
        return await completions.create(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request):
        return await chat.create(request, raw_request)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    return app
