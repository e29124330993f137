"""A server warms up before /health answers 200 (--warm-up): its first requests run as fast as the ones after,
/health answers 503 naming what it prepares until it is done, and then what start-up made is frozen out of the
cycle collector's sight (long_lived.py) until the server stops."""
import gc
import http.client
import json
import random
import string
import threading
import time

import uvicorn

from tests.entrypoints.conftest import Server, running_server
from tpengine.distributed.parallel_state import find_free_port
from tpengine.entrypoints.api_server import build_app
from tpengine.entrypoints.metrics import Metrics
from tpengine.entrypoints.renderer import PromptRenderer

NUM_REQUESTS = 8
PROMPT_CHARS = 200  # the byte tokenizer: a token each
OUTPUT_TOKENS = 96  # enough decode steps that a batch takes a few tenths of a second: noise stays small beside it


def streamed_completion(server: Server, prompt: str) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        body = {"model": server.model_name, "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "min_tokens": OUTPUT_TOKENS,
                "temperature": 0, "stream": True}
        connection.request("POST", "/v1/completions", body=json.dumps(body),
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        text = response.read().decode()
    finally:
        connection.close()
    assert response.status == 200 and text.rstrip().endswith("data: [DONE]"), text[-500:]


def concurrent_batch_s(server: Server, prompts: list[str]) -> float:
    """Wall time of the prompts sent at once, each a streamed completion."""
    errors = []

    def send(prompt):
        try:
            streamed_completion(server, prompt)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=send, args=(prompt,)) for prompt in prompts]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    return time.monotonic() - started


def test_the_first_requests_after_health_are_as_fast_as_the_next(tied_model, monkeypatch):
    # without the warm-up the first 8 took ~5x the next 8 on the tiny model: the first decode step of each
    # batch size recorded its CPU replay, and the first recording imported torch._dynamo (~2 s).
    # One compute thread: what a first use costs does not depend on it, and two threads that wait for each other
    # at every op's end turn a core taken by another process (a shared 2-core machine) into a step 10x as slow
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    rng = random.Random(0)
    # every prompt its own from the first token: no batch reads another's prefix from the cache
    prompts = ["".join(rng.choices(string.ascii_letters, k=PROMPT_CHARS)) for _ in range(2 * NUM_REQUESTS)]
    fixture = running_server(tied_model, "--warm-up")
    server = next(fixture)
    try:
        first = concurrent_batch_s(server, prompts[:NUM_REQUESTS])
        second = concurrent_batch_s(server, prompts[NUM_REQUESTS:])
    finally:
        next(fixture, None)
    assert first <= 1.5 * second, f"the first {NUM_REQUESTS} took {first:.2f} s, the next {second:.2f} s"


class _BlockedCompilerEngine:
    """An LLMEngine stand-in whose grammar compiler is made only once the test releases it."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.release = threading.Event()

    @property
    def grammar_compiler(self):
        assert self.release.wait(30), "the test never released the grammar compiler"
        return object()


class _IdleAsyncEngine:
    """The AsyncEngine the app sees: healthy, never given a request."""
    error = None
    is_healthy = True

    def __init__(self, engine):
        self.engine = engine

    def start(self):
        pass

    def stop(self):
        pass


def health(port: int) -> tuple[int, dict | None]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", "/health")
        response = connection.getresponse()
        body = response.read()
    finally:
        connection.close()
    return response.status, json.loads(body) if body else None


def test_health_is_503_naming_what_warms_up_until_it_is_done(tied_model):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tied_model)
    engine = _IdleAsyncEngine(_BlockedCompilerEngine(tokenizer))
    renderer = PromptRenderer(tokenizer, None, 512)
    app = build_app(engine, renderer=renderer, tokenizer=tokenizer, model_name="tiny", model_path=tied_model,
                    max_model_len=512, max_request_len=512, metrics=Metrics("tiny"), warm_up=True)
    port = find_free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline, "the app did not start"
            time.sleep(0.02)
        status, body = health(port)
        assert status == 503 and body["error"]["code"] == "warming_up"
        assert "grammar compiler" in body["error"]["message"]
        engine.engine.release.set()
        while (status := health(port)[0]) != 200:
            assert status == 503 and time.monotonic() < deadline, status
            time.sleep(0.02)
        # what start-up made is out of the cycle collector's sight once ready: no full collection walks it
        assert gc.get_freeze_count() > 0
    finally:
        engine.engine.release.set()
        server.should_exit = True
        thread.join(30)
    assert gc.get_freeze_count() == 0  # handed back when the server stopped: this process goes on
