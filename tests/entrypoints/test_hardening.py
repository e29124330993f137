"""What a hostile client tries, through the real server: memory that outlives requests, work on the event
loop that grows with the input, fields accepted and then ignored, loose types, errors that point at the
wrong field, the Authorization scheme's case, slow uploads and uploads that SIGTERM interrupts."""
import asyncio
import json
import signal
import socket
import threading
import time

import openai
import pytest

from tests.entrypoints.conftest import BLOCK_SIZE, Server
from tests.entrypoints.test_errors import assert_openai_error
from tpengine.entrypoints.server import GRACEFUL_SHUTDOWN_S
from tpengine.sampling_params import MAX_STOP_STRING_LENGTH, MAX_STOP_STRINGS

LONG_STOP = "xy" * 5000  # 10k characters


def post(server, path: str, body: dict) -> tuple[int, dict]:
    return server.request("POST", path, {"model": "tiny", **body})


def assert_400_naming(server, path: str, body: dict, param: str, *message_parts: str) -> None:
    status, answer = post(server, path, body)
    assert status == 400, answer
    assert_openai_error(status, answer, *message_parts)
    assert answer["error"]["param"] == param, answer


# --- memory -------------------------------------------------------------------------------------------

async def mixed_requests(server, count: int, start: int) -> None:
    """count requests, 8 at a time: n=4 with 10k-character stop strings and logprobs, chats, and streams
    that the client drops after their first chunk (the server aborts them)."""
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120.0)
    limit = asyncio.Semaphore(8)

    async def one(i: int) -> None:
        async with limit:
            kind = i % 4
            if kind == 0:
                await client.completions.create(model="tiny", prompt=f"def foo{i}():", max_tokens=24, n=4,
                                                logprobs=5, stop=[LONG_STOP, "\n\n\n\n"], temperature=1.0)
            elif kind == 1:
                await client.chat.completions.create(model="tiny", max_completion_tokens=24, logprobs=True,
                                                     top_logprobs=3, stop=[LONG_STOP],
                                                     messages=[{"role": "user", "content": f"hello {i}"}])
            elif kind == 2:
                stream = await client.completions.create(model="tiny", prompt=f"abort me {i}", max_tokens=200,
                                                         stream=True, extra_body={"ignore_eos": True})
                async for _ in stream:
                    break
                await stream.close()
            else:
                await client.completions.create(model="tiny", prompt=[i % 200 + 1] * 40, max_tokens=16, n=2,
                                                extra_body={"ignore_eos": True, "return_token_ids": True})

    try:
        await asyncio.gather(*(one(i) for i in range(start, start + count)))
    finally:
        await client.close()


def test_server_memory_after_200_mixed_requests_stays_within_50_mb_of_after_the_first_10(server):
    asyncio.run(mixed_requests(server, 10, 0))
    after_10 = server.rss_bytes
    asyncio.run(mixed_requests(server, 190, 10))
    deadline = time.monotonic() + 20  # dropped streams are aborted by the engine thread's next drain
    while server.metric("tpengine:num_requests_running", model_name="tiny") and time.monotonic() < deadline:
        time.sleep(0.1)
    growth = server.rss_bytes - after_10
    assert growth < 50 * 1024 * 1024, f"RSS grew by {growth / 2**20:.1f} MB over 190 requests"


def test_stop_strings_over_the_limits_get_400_naming_them(server):
    assert_400_naming(server, "/v1/completions", {"prompt": "a", "stop": ["x" * (MAX_STOP_STRING_LENGTH + 1)]},
                      "stop", str(MAX_STOP_STRING_LENGTH))
    assert_400_naming(server, "/v1/completions", {"prompt": "a", "stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]},
                      "stop", str(MAX_STOP_STRINGS))
    status, answer = post(server, "/v1/completions", {"prompt": "a", "max_tokens": 4, "stop": ["xy" * 8000]})
    assert status == 200 and answer["choices"][0]["text"] is not None


# --- the event loop -----------------------------------------------------------------------------------

def test_health_p99_stays_under_100_ms_while_10_mb_prompts_are_rejected(server):
    body = json.dumps({"model": "tiny", "prompt": "a " * (5 * 2**20), "max_tokens": 1})  # 10 MB of text
    answers, latencies, done = [], [], threading.Event()

    def send_big_prompts():
        try:
            for _ in range(4):
                answers.append(server.request("POST", "/v1/completions", body, {"Content-Type": "application/json"},
                                              timeout=60))
        finally:
            done.set()

    sender = threading.Thread(target=send_big_prompts)
    sender.start()
    while not done.is_set():
        started = time.monotonic()
        assert server.request("GET", "/health", timeout=10)[0] == 200
        latencies.append(time.monotonic() - started)
        time.sleep(0.005)
    sender.join()
    assert [status for status, _ in answers] == [400] * 4
    assert_openai_error(400, answers[0][1], "characters", "512 tokens")
    assert answers[0][1]["error"]["param"] == "prompt"
    latencies.sort()
    assert len(latencies) >= 5
    assert latencies[int(0.99 * (len(latencies) - 1))] < 0.1, latencies[-5:]


def test_chat_messages_too_long_to_fit_are_rejected_before_the_template_runs(server):
    assert_400_naming(server, "/v1/chat/completions",
                      {"messages": [{"role": "user", "content": "b" * 2_000_000}]}, "messages", "characters")


# --- fields that are honoured, and those refused by name -----------------------------------------------

def test_logit_bias_is_honoured(server, client):
    ids = client.completions.create(model="tiny", prompt="abc", max_tokens=6, temperature=0.0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0].token_ids
    forced = (ids[0] + 1) % 200 + 1
    for extra in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 5}):
        choice = client.completions.create(model="tiny", prompt="abc", max_tokens=6, logit_bias={str(forced): 100},
                                           extra_body={"ignore_eos": True, "return_token_ids": True},
                                           **extra).choices[0]
        assert choice.token_ids == [forced] * 6
    banned = client.completions.create(model="tiny", prompt="abc", max_tokens=6, temperature=0.0,
                                       logit_bias={str(ids[0]): -100},
                                       extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0]
    assert banned.token_ids[0] != ids[0]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "a", "logit_bias": {"99999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"five": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "a", "best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": "a", "n": 2, "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "a", "suffix": "end"}, "suffix"),
    ("/v1/completions", {"prompt": "a", "frobnicate": True}, "frobnicate"),
    ("/v1/completions", {"prompt": "a", "guided_json": {"type": "object"}}, "guided_json"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"function_call": "auto"}, "function_call"),
    ("/v1/chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("/v1/chat/completions", {"reasoning_effort": "high"}, "reasoning_effort"),
    ("/v1/chat/completions", {"store": True}, "store"),
    ("/v1/chat/completions", {"service_tier": "flex"}, "service_tier"),
    ("/v1/chat/completions", {"stream": True, "stream_options": {"include_obfuscation": True}},
     "stream_options.include_obfuscation"),
])
def test_fields_that_cannot_be_honoured_get_400_naming_them(server, path, body, param):
    if path.endswith("chat/completions"):
        body = {"messages": [{"role": "user", "content": "hi"}], **body}
    assert_400_naming(server, path, body, param, param.split(".")[-1])


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "a", "best_of": 2, "n": 2, "suffix": None, "user": "u-1"}),
    ("/v1/completions", {"prompt": "a", "suffix": "", "logit_bias": {}}),
    ("/v1/chat/completions", {"response_format": {"type": "text"}, "tool_choice": "none", "store": False,
                              "modalities": ["text"], "service_tier": "auto", "user": "u-2"}),
])
def test_neutral_values_of_unimplemented_fields_are_accepted(server, path, body):
    if path.endswith("chat/completions"):
        body = {"messages": [{"role": "user", "content": "hi"}], **body}
    status, answer = post(server, path, {"max_tokens": 2, **body})
    assert status == 200, answer


# --- types --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "a", "temperature": "0.5"}, "temperature"),
    ("/v1/completions", {"prompt": "a", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "a", "n": True}, "n"),
    ("/v1/completions", {"prompt": "a", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 2.0}, "max_tokens"),
    ("/v1/completions", {"prompt": [1.0, 2.0]}, "prompt"),
    ("/v1/completions", {"prompt": "a", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": "a", "seed": 1.5}, "seed"),
    ("/v1/completions", {"prompt": "a", "stop_token_ids": [True]}, "stop_token_ids.0"),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"top_p": "1"}, "top_p"),
])
def test_loose_types_get_400_naming_the_field(server, path, body, param):
    if path.endswith("chat/completions"):
        body = {"messages": [{"role": "user", "content": "hi"}], **body}
    assert_400_naming(server, path, body, param, param)


def test_an_integer_is_a_number(server):
    status, answer = post(server, "/v1/completions", {"prompt": "a", "temperature": 1, "top_p": 1, "max_tokens": 2})
    assert status == 200, answer


# --- error bodies name the field at fault -------------------------------------------------------------

@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "a", "stop_token_ids": [10**6]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "a", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "a", "top_k": 0}, "top_k"),
    ("/v1/completions", {"prompt": "a", "min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ("/v1/completions", {"prompt": [5] * 600}, "prompt"),
    ("/v1/completions", {"prompt": ["a", [10**6]]}, "prompt"),
    ("/v1/chat/completions", {"presence_penalty": 3}, "presence_penalty"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "b" * 600}]}, "messages"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_errors_name_the_request_field_at_fault(server, path, body, param):
    if path.endswith("chat/completions"):
        body = {"messages": [{"role": "user", "content": "hi"}], **body}
    assert_400_naming(server, path, body, param)


# --- authorization and metrics ------------------------------------------------------------------------

def test_metrics_label_the_served_name_not_the_model_path(server, tied_model):
    status, text = server.request("GET", "/metrics")
    assert status == 200 and 'model_name="tiny"' in text
    assert tied_model not in text


# --- slow uploads, and uploads that SIGTERM interrupts --------------------------------------------------

def start_upload(server) -> socket.socket:
    """A POST whose headers promise a body that never fully arrives."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100000\r\n\r\n" + b'{"model": "tiny", "prompt": "')
    return sock


def read_response(sock: socket.socket) -> tuple[int | None, dict | None]:
    """(status, JSON body) of what the server answered, or (None, None) if it closed without an answer."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    if not data:
        return None, None
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_slow_uploads_get_408_and_at_sigterm_uploads_get_503_and_shutdown_is_prompt_and_quiet(tied_model, tmp_path):
    log = open(tmp_path / "stderr.log", "wb")
    server = Server("--model", tied_model, "--block-size", str(BLOCK_SIZE), "--num-kvcache-blocks", "32",
                    "--max-model-len", "256", "--body-timeout", "1.5", stderr=log)
    try:
        started = time.monotonic()
        status, body = read_response(start_upload(server))
        assert status == 408 and time.monotonic() - started < 10
        assert_openai_error(status, body, "1.5 s")
        assert server.request("GET", "/health")[0] == 200

        uploads = [start_upload(server) for _ in range(3)]
        time.sleep(0.3)
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        answers = [read_response(sock) for sock in uploads]
        assert server.process.wait(timeout=30) == 0
        assert time.monotonic() - signalled < GRACEFUL_SHUTDOWN_S + 1
        for status, body in answers:  # an OpenAI-shaped 503, or the connection closed
            assert status in (503, None)
            if status is not None:
                assert_openai_error(status, body, "shutting down")
    finally:
        server.kill_leftovers()
        log.close()
    errors = (tmp_path / "stderr.log").read_text()
    assert "Traceback" not in errors and "ERROR" not in errors, errors
