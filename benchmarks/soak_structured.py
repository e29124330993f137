"""Soak: a server sent --requests completions, each with a JSON schema of its own, and its resident memory.

With --prompt-words N each request's prompt is N random words of its own too (distinct long prompts); with
--no-schema the requests are plain completions.

`tpengine serve` (the embedded tiny model unless --model) gets --requests /v1/completions requests, --concurrency
at a time, each constrained by a distinct --properties-property schema, so every one compiles a new grammar. The
server's RSS is read every --every requests. Compiled grammars are cached up to the compiler's byte bound
(tpengine/structured/compiler.py: CACHE_LIMIT_BYTES), so RSS should rise while the cache fills and then level:
the script reports the growth over the last third of the run against the first third's and fails (exit 1) when
the last third grew more than --max-late-growth-mb.

    .venv/bin/python benchmarks/soak_structured.py [--requests 3000] [--model PATH]
    .venv/bin/python benchmarks/soak_structured.py --no-schema --prompt-words 300 --requests 1600
    .venv/bin/python benchmarks/soak_structured.py --quick     # 60 requests: the harness itself
"""
import argparse
import http.client
import json
import os
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from tpengine.distributed.parallel_state import find_free_port


def schema_of(index: int, num_properties: int) -> dict:
    names = [f"field_{index}_{j}" for j in range(num_properties)]
    return {"type": "object", "properties": {name: {"type": "string", "maxLength": 8} for name in names},
            "required": names[:2]}


def prompt_of(index: int, num_words: int) -> str:
    """A prompt of its own: num_words random lowercase words (no two requests share a prefix block)."""
    rng = random.Random(index)
    return " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8)))
                    for _ in range(num_words)) if num_words else "x"


def request_body(index: int, args) -> dict:
    body = {"prompt": prompt_of(index, args.prompt_words), "max_tokens": args.max_tokens, "temperature": 1.0,
            "seed": index}
    if not args.no_schema:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": f"s{index}", "schema": schema_of(index, args.properties)}}
    return body


def post(port: int, body: dict) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        connection.request("POST", "/v1/completions", body=json.dumps(body),
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        response.read()
        return response.status
    finally:
        connection.close()


def resident_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def start_server(model: str | None) -> tuple[subprocess.Popen, int]:
    port = find_free_port()
    command = [sys.executable, "-m", "tpengine.cli", "serve", "--port", str(port), "--quiet"]
    if model:
        command += ["--model", model]
    server = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while True:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with {server.returncode}")
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return server, port
        except OSError:
            pass
        if time.monotonic() > deadline:
            server.kill()
            raise SystemExit("the server did not start within 300 s")
        time.sleep(0.2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--properties", type=int, default=30, help="properties per schema")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--every", type=int, default=250, help="requests between RSS readings")
    parser.add_argument("--max-late-growth-mb", type=float, default=64.0,
                        help="most RSS the last third of the run may add")
    parser.add_argument("--prompt-words", type=int, default=0, help="random words in each request's own prompt "
                                                                  "(0: the prompt is 'x')")
    parser.add_argument("--no-schema", action="store_true", help="plain completions, no response_format")
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the embedded tiny model)")
    parser.add_argument("--quick", action="store_true", help="60 requests, readings every 20, no levelling verdict")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.every = 60, 20
    server, port = start_server(args.model)
    readings = [(0, resident_mb(server.pid))]
    statuses: dict[int, int] = {}
    started = time.perf_counter()
    try:
        with ThreadPoolExecutor(args.concurrency) as pool:
            for first in range(0, args.requests, args.every):
                batch = range(first, min(first + args.every, args.requests))
                for status in pool.map(lambda i: post(port, request_body(i, args)), batch):
                    statuses[status] = statuses.get(status, 0) + 1
                readings.append((batch[-1] + 1, resident_mb(server.pid)))
                print(f"{readings[-1][0]:>6} requests  RSS {readings[-1][1]:8.1f} MB  "
                      f"({time.perf_counter() - started:6.1f} s)", flush=True)
    finally:
        server.terminate()
        server.wait(timeout=60)
    third = (len(readings) - 1) // 3
    early, late = readings[third][1] - readings[0][1], readings[-1][1] - readings[-1 - third][1]
    print(json.dumps({"requests": args.requests, "statuses": statuses, "rss_start_mb": readings[0][1],
                      "rss_end_mb": readings[-1][1], "first_third_growth_mb": round(early, 1),
                      "last_third_growth_mb": round(late, 1), "cpu_count": os.cpu_count()}))
    if statuses != {200: args.requests}:
        print(f"not every request was answered 200: {statuses}")
        return 1
    if late > args.max_late_growth_mb and not args.quick:  # 60 requests cannot fill the cache: no verdict
        print(f"RSS grew {late:.1f} MB over the last third, more than {args.max_late_growth_mb} MB: it did not level")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
