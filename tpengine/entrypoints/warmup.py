"""What a server's first requests would pay outside the engine, paid before /health answers 200 (with
EngineConfig.warm_up; the engine's own warm-up, on every rank, is runner/warmup.py, done before the server listens):
the chat template's compile and the tokenizer's first encode, on the renderer's thread, and the structured-outputs
grammar compiler (xgrammar's import and the vocabulary's tables: up to seconds, which the first structured request
would otherwise spend on the event loop, stalling every stream)."""
import asyncio
import logging
import time

from tpengine.entrypoints.async_engine import AsyncEngine
from tpengine.entrypoints.renderer import PromptRenderer
from tpengine.long_lived import freeze_start_up_objects

logger = logging.getLogger("tpengine")


class Readiness:
    """What the server is still preparing; /health answers 503 naming it until it is done (None)."""

    def __init__(self, preparing: str | None = None):
        self.preparing = preparing


def front_end_parts(engine: AsyncEngine, renderer: PromptRenderer) -> list[str]:
    """What warm_up_front_end prepares for this model, in words."""
    if renderer.tokenizer is None:
        return []
    return ["the chat template and tokenizer", *(["the grammar compiler"] if engine.engine.tokenizer is not None
                                                 else [])]


async def warm_up_front_end(engine: AsyncEngine, renderer: PromptRenderer, readiness: Readiness) -> None:
    """Prepare front_end_parts, then mark the server ready. A part that fails is logged and left to the first
    request that needs it (which then gets the error): the server still serves every other request."""
    started = time.monotonic()
    if renderer.tokenizer is not None:
        try:
            await renderer.run(renderer.warm_up)
        except Exception as e:  # a template that refuses a lone user message: the requests' own will tell
            logger.warning("warm-up: the chat template did not render a test message: %s", e)
    if engine.engine.tokenizer is not None:
        try:  # made on first use; under its lock, so a request that needs it meanwhile waits for this one
            await asyncio.to_thread(lambda: engine.engine.grammar_compiler)
        except Exception as e:
            logger.warning("warm-up: the grammar compiler could not be made: %s", e)
    freeze_start_up_objects()
    readiness.preparing = None
    logger.info("ready: the server warmed up in %.1f s", time.monotonic() - started)
