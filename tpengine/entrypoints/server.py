"""`tpengine serve`: load the engine, bind, serve until SIGTERM or SIGINT, then stop everything."""
import asyncio
import logging
import signal
import socket

import uvicorn

from tpengine.entrypoints.api_server import BODY_TIMEOUT_S, Draining, build_app
from tpengine.entrypoints.async_engine import AsyncEngine
from tpengine.entrypoints.chat_template import load_chat_template
from tpengine.entrypoints.lora_modules import LoRAModulePath, ServedModels
from tpengine.entrypoints.metrics import Metrics
from tpengine.entrypoints.renderer import PromptRenderer

logger = logging.getLogger("tpengine")

# After SIGTERM/SIGINT running requests get this long to finish before they are aborted.
GRACEFUL_SHUTDOWN_S = 3


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before the slow engine start, so a taken port fails at once (not listening yet:
    clients are refused, not left waiting, until the server is ready)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


class _Server(uvicorn.Server):
    """uvicorn, plus: once it stops accepting, running requests get GRACEFUL_SHUTDOWN_S to finish, then
    are aborted, so every client gets a proper end (finish_reason "abort") instead of a cut connection."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, draining: Draining):
        super().__init__(config)
        self.engine = engine
        self.draining = draining

    async def shutdown(self, sockets=None) -> None:
        self.draining.set()  # bodies still arriving get a 503 now: they would not run anyway
        asyncio.get_running_loop().call_later(GRACEFUL_SHUTDOWN_S, self.engine.abort_all)
        await super().shutdown(sockets)


def _served_models(model_name: str, model: str, lora_modules: list[LoRAModulePath],
                   engine_kwargs: dict) -> ServedModels:
    """The served model and --lora-modules' adapters, each checked before the engine's slow start (ValueError)."""
    max_lora_rank = engine_kwargs["max_lora_rank"] if engine_kwargs.get("enable_lora") else None
    served_models = ServedModels(model_name, model, max_lora_rank)
    names = [module.name for module in lora_modules]
    for name in names:
        if names.count(name) > 1:  # before any folder is read: this mistake is in the command itself
            raise ValueError(f"--lora-modules names {name!r} {names.count(name)} times: each adapter needs its own")
    for module in lora_modules:
        try:
            served_models.add(module)
        except ValueError as e:
            raise ValueError(f"--lora-modules {module.name}: {e}") from None
    return served_models


def _check_lora_modules(llm_engine, served_models: ServedModels) -> None:
    """--lora-modules' weights checked against the model by the engine, before the server takes requests."""
    for lora_request in served_models.lora_requests:
        try:
            llm_engine.add_lora(lora_request)
        except ValueError as e:
            raise ValueError(f"--lora-modules {lora_request.lora_name}: {e}") from None


def run_server(*, model: str, model_name: str, host: str, port: int, api_key: str | None,
               chat_template: str | None, access_log: bool, log_level: str, engine_kwargs: dict,
               body_timeout_s: float = BODY_TIMEOUT_S, tool_parser: str | None = None,
               enable_auto_tool_choice: bool = False, lora_modules: list[LoRAModulePath] = (),
               allow_runtime_lora_updating: bool = False) -> int:
    from tpengine.engine.llm_engine import LLMEngine, load_tokenizer

    chat_template = load_chat_template(chat_template)
    served_models = _served_models(model_name, model, lora_modules, engine_kwargs)
    sock = bind_socket(host, port)
    # Until uvicorn takes the signals over, SIGTERM interrupts the engine's start as Ctrl-C does,
    # so the finally below still stops any worker already started.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    llm_engine = server = None
    try:
        llm_engine = LLMEngine(model, **engine_kwargs)
        _check_lora_modules(llm_engine, served_models)
        # One tokenizer per thread that uses it (a Rust tokenizer must not be used from two at once): the
        # engine thread has the engine's, the renderer's thread and the event loop one each.
        # the engine's rule (its folder's, a GGUF file's, or --tokenizer's), loaded afresh for each
        tokenizer = renderer_tokenizer = None
        if llm_engine.tokenizer is not None:
            tokenizer, renderer_tokenizer = (load_tokenizer(model, llm_engine.config.tokenizer) for _ in range(2))
        renderer = PromptRenderer(renderer_tokenizer, chat_template, llm_engine.max_request_len,
                                  loop_tokenizer=tokenizer)
        metrics = Metrics(model_name)
        engine = AsyncEngine(llm_engine, metrics)
        draining = Draining()
        app = build_app(engine, renderer=renderer, tokenizer=tokenizer, model_name=model_name, model_path=model,
                        max_model_len=llm_engine.max_model_len, max_request_len=llm_engine.max_request_len,
                        metrics=metrics, api_key=api_key, body_timeout_s=body_timeout_s, draining=draining,
                        tool_parser=tool_parser, enable_auto_tool_choice=enable_auto_tool_choice,
                        reasoning_parser=engine_kwargs.get("reasoning_parser"), warm_up=llm_engine.config.warm_up,
                        served_models=served_models, allow_runtime_lora_updating=allow_runtime_lora_updating)
        # uvicorn's own limit is a backstop: by then abort_all has ended every request
        config = uvicorn.Config(app, log_level=log_level, access_log=access_log,
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S + 5)
        server = _Server(config, engine, draining)
        # uvicorn re-raises the signal that stopped it once it is done; ours then only returns, so the
        # process exits 0 after a clean shutdown.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        logger.info("serving %s as %r on http://%s:%d", model, model_name, host, port)
        server.run(sockets=[sock])
    finally:
        sock.close()
        if llm_engine is not None:
            llm_engine.shutdown()  # already done by the app's shutdown, unless startup failed
    return 0 if server.started else 1
