"""A minimal asyncio HTTP client for the OpenAI API (no client library, so its own CPU cost stays small next to the
server's on a small machine), and a `tpengine serve` child process to point it at.

Per request it records when it was sent and when each streamed chunk with tokens came: the time to the first token
(TTFT), the gaps between chunks (inter-token latency, ITL), the time per output token after the first (TPOT, as
vLLM's client computes it) and the end-to-end latency (E2EL) follow from those.
"""
import asyncio
import json
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Endpoint:
    """A server to send requests to: its address, the model name it serves, and the API key it wants (if any)."""
    host: str
    port: int
    model: str = ""
    api_key: str | None = None


async def http(endpoint: Endpoint, method: str, path: str, body: dict | None = None, version: str = "1.1"):
    """Send one request; returns (status, the response's reader, writer) after its headers. An HTTP/1.1 answer may
    come in chunks; an HTTP/1.0 one comes whole, ended by the connection's close."""
    reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
    payload = b"" if body is None else json.dumps(body).encode()
    auth = f"Authorization: Bearer {endpoint.api_key}\r\n" if endpoint.api_key else ""
    writer.write(f"{method} {path} HTTP/{version}\r\nHost: {endpoint.host}\r\nContent-Type: application/json\r\n{auth}"
                 f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
    status = int((await reader.readline()).split()[1])
    while (await reader.readline()) not in (b"\r\n", b""):
        pass
    return status, reader, writer


async def request_json(endpoint: Endpoint, method: str, path: str, body: dict | None = None) -> tuple[int, object]:
    """(status, the decoded JSON body) of one request that is not streamed."""
    status, reader, writer = await http(endpoint, method, path, body, version="1.0")
    raw = await reader.read()
    writer.close()
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw.decode(errors="replace")


async def stream_completion(endpoint: Endpoint, prompt: list[int], max_tokens: int, temperature: float) -> dict:
    """One streamed /v1/completions request of token ids writing exactly max_tokens (ignore_eos): when it was sent,
    when each chunk with tokens came, and how many tokens came (vLLM's return_token_ids)."""
    body = {"model": endpoint.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    sent = time.perf_counter()
    status, reader, writer = await http(endpoint, "POST", "/v1/completions", body)
    if status != 200:
        writer.close()
        raise ValueError(f"the server answered {status} to /v1/completions")
    token_times, num_tokens = [], 0
    async for line in reader:  # chunked transfer: size lines interleave, the SSE lines are what count
        if line.startswith(b"data: {"):
            new = sum(len(choice.get("token_ids") or ()) for choice in json.loads(line[6:])["choices"])
            if new:
                token_times.append(time.perf_counter())
                num_tokens += new
    writer.close()
    return {"sent": sent, "token_times": token_times, "num_tokens": num_tokens}


async def poll_health(endpoint: Endpoint, stop: asyncio.Event, latencies: list[float]) -> None:
    """GET /health every 50 ms until stop, each one's seconds into latencies (it must never wait for a step)."""
    while not stop.is_set():
        started = time.perf_counter()
        status, reader, writer = await http(endpoint, "GET", "/health")
        await reader.read()
        writer.close()
        assert status == 200, f"/health answered {status}"
        latencies.append(time.perf_counter() - started)
        await asyncio.sleep(0.05)


async def run_load(endpoint: Endpoint, prompts: list[list[int]], output_lens: list[int], temperature: float,
                   request_rate: float = float("inf"), seed: int = 0, warm_up: bool = True,
                   max_concurrency: int | None = None) -> tuple[list[dict], float, list[float]]:
    """Send every request, all at once (request_rate inf) or with Poisson arrivals at request_rate a second, at
    most max_concurrency in flight; (each request's record, seconds from the first sent to the last token,
    /health latencies meanwhile)."""
    if warm_up:
        await stream_completion(endpoint, prompts[0][:4], 4, temperature)
    rng = random.Random(seed + 1)
    limit = asyncio.Semaphore(max_concurrency or len(prompts))
    stop, health = asyncio.Event(), []
    poller = asyncio.ensure_future(poll_health(endpoint, stop, health))

    async def limited(prompt, max_tokens):
        async with limit:
            return await stream_completion(endpoint, prompt, max_tokens, temperature)

    started = time.perf_counter()
    tasks = []
    for prompt, max_tokens in zip(prompts, output_lens):
        tasks.append(asyncio.ensure_future(limited(prompt, max_tokens)))
        if request_rate != float("inf"):
            await asyncio.sleep(rng.expovariate(request_rate))
    try:
        results = await asyncio.gather(*tasks)
    finally:
        stop.set()
        await poller
    return results, max(r["token_times"][-1] for r in results) - started, health


def latencies(results: list[dict]) -> dict[str, list[float]]:
    """Per-request TTFT, TPOT ((last - first token) / (tokens - 1), vLLM's), E2EL, and every ITL gap, in ms."""
    return {
        "TTFT": [(r["token_times"][0] - r["sent"]) * 1e3 for r in results],
        "TPOT": [(r["token_times"][-1] - r["token_times"][0]) * 1e3 / (r["num_tokens"] - 1)
                 for r in results if r["num_tokens"] > 1],
        "ITL": [(b - a) * 1e3 for r in results for a, b in zip(r["token_times"], r["token_times"][1:])],
        "E2EL": [(r["token_times"][-1] - r["sent"]) * 1e3 for r in results],
    }


# --- a `tpengine serve` child -----------------------------------------------------------------------------

def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_server(port: int, serve_argv: list[str], quiet: bool = True) -> subprocess.Popen:
    """`tpengine serve --port PORT` with serve_argv, in this interpreter, on 127.0.0.1."""
    command = [sys.executable, "-m", "tpengine.cli", "serve", "--port", str(port), "--disable-access-log",
               *(["--quiet"] if quiet else []), *serve_argv]
    return subprocess.Popen(command, stdin=subprocess.DEVNULL)


def wait_ready(endpoint: Endpoint, process: subprocess.Popen | None = None, timeout: float = 600.0) -> None:
    """Until GET /health answers 200; a ValueError if process exits first or timeout passes."""
    deadline = time.monotonic() + timeout
    while True:
        if process is not None and process.poll() is not None:
            raise ValueError(f"the server exited with {process.returncode} before it was ready")
        try:
            with socket.create_connection((endpoint.host, endpoint.port), timeout=1.0) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                if s.recv(64).split()[1] == b"200":
                    return
        except (OSError, IndexError):
            pass
        if time.monotonic() > deadline:
            raise ValueError(f"the server at {endpoint.host}:{endpoint.port} was not ready within {timeout:g} s")
        time.sleep(0.2)


def stop_server(process: subprocess.Popen, timeout: float = 60.0) -> int:
    """SIGTERM, then its exit status (killed if it takes longer than timeout)."""
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()
