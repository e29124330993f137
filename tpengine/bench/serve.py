"""`tpengine bench serve`: an OpenAI-API server under load, as `vllm bench serve` measures it.

The server is the one at --base-url (or --host/--port), or else a `tpengine serve` this command starts with the
engine flags given and stops at the end. --num-prompts streamed /v1/completions requests, each --input-len random
token ids writing exactly --output-len tokens (ignore_eos), go all at once (--request-rate inf, the default) or
with Poisson arrivals, at most --max-concurrency in flight. The token ids are drawn from what the server's own
/tokenize makes of a random text, so they are the model's. Prints throughput and the mean, median and p99 of the
time to first token (TTFT), time per output token (TPOT), inter-token latency (ITL) and end-to-end latency (E2EL),
under vLLM's names; --output-json writes them with the run's record.
"""
import asyncio
import os
import random
import statistics
from urllib.parse import urlsplit

from tpengine.bench.client import (Endpoint, free_port, latencies, request_json, run_load, start_server, stop_server,
                                   wait_ready)
from tpengine.bench.results import Record
from tpengine.bench.workload import percentile

METRICS = (("ttft", "TTFT", "Time to First Token"), ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
           ("itl", "ITL", "Inter-token Latency"), ("e2el", "E2EL", "End-to-end Latency"))


def add_arguments(parser) -> None:
    parser.add_argument("--base-url", help="the server to measure, e.g. http://127.0.0.1:8000 (default: start one "
                                           "with the engine flags)")
    parser.add_argument("--host", help="the server's host, with --port (default: start one)")
    parser.add_argument("--port", type=int, help="the server's port (default 8000 with --host)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="the server's API key (default: $OPENAI_API_KEY)")
    parser.add_argument("--input-len", type=int, default=1024, help="prompt tokens per request (default 1024)")
    parser.add_argument("--output-len", type=int, default=128, help="tokens each request writes (default 128)")
    parser.add_argument("--num-prompts", type=int, default=1000, help="requests (default 1000)")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests a second, Poisson arrivals; inf sends them all at once (default inf)")
    parser.add_argument("--max-concurrency", type=int, help="requests in flight at most (default: no limit)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    parser.add_argument("--seed", dest="workload_seed", type=int, default=0, metavar="SEED",
                        help="the random prompts' and arrivals' seed (default 0)")
    parser.add_argument("--output-json", metavar="PATH", help="also write the figures to PATH as JSON")


def endpoint_of(args) -> Endpoint | None:
    """The server --base-url or --host/--port names, or None: start one."""
    if args.base_url:
        url = urlsplit(args.base_url)
        if url.scheme != "http" or not url.hostname:
            raise ValueError(f"--base-url must be an http:// address, got {args.base_url!r}")
        return Endpoint(url.hostname, url.port or 80, api_key=args.api_key)
    if args.host or args.port:
        return Endpoint(args.host or "127.0.0.1", args.port or 8000, api_key=args.api_key)
    return None


def check_arguments(args) -> None:
    for flag in ("input_len", "output_len", "num_prompts"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")


def run(args, engine_argv: list[str], argv: list[str] | None = None) -> int:
    """Measure the server args name, or one started with engine_argv (the engine flags given)."""
    check_arguments(args)
    endpoint = endpoint_of(args)
    if endpoint is not None:
        if engine_argv:
            raise ValueError(f"engine flags ({' '.join(engine_argv)}) apply only to a server bench serve starts, "
                             "not to one at --base-url or --host/--port")
        return measure(args, endpoint, argv)
    endpoint = Endpoint("127.0.0.1", free_port(), api_key=args.api_key)
    server = start_server(endpoint.port, engine_argv + (["--api-key", args.api_key] if args.api_key else []))
    try:
        wait_ready(endpoint, server)
        measure(args, endpoint, argv)
    finally:
        exit_status = stop_server(server)
    print(f"the server it started exited with {exit_status}")
    return 0


def measure(args, endpoint: Endpoint, argv: list[str] | None) -> int:
    record = Record("serve", argv, f"server at {endpoint.host}:{endpoint.port}", program="tpengine")
    try:
        endpoint, pool = asyncio.run(_model_and_token_pool(endpoint))
    except OSError as e:
        raise ValueError(f"cannot reach the server at {endpoint.host}:{endpoint.port}: {e.strerror or e}") from None
    rng = random.Random(args.workload_seed)
    prompts = [rng.choices(pool, k=args.input_len) for _ in range(args.num_prompts)]
    output_lens = [args.output_len] * args.num_prompts
    results, duration, _ = asyncio.run(run_load(endpoint, prompts, output_lens, args.temperature, args.request_rate,
                                                args.workload_seed, max_concurrency=args.max_concurrency))
    figures = _figures(results, duration, args.input_len)
    _print_figures(figures, endpoint)
    record.write(args.output_json, model=endpoint.model, input_len=args.input_len, output_len=args.output_len,
                 request_rate=args.request_rate, max_concurrency=args.max_concurrency, **figures)
    return 0


async def _model_and_token_pool(endpoint: Endpoint) -> tuple[Endpoint, list[int]]:
    """The endpoint with the model the server serves (its /v1/models' first), and the token ids its /tokenize
    makes of a random text."""
    status, models = await request_json(endpoint, "GET", "/v1/models")
    if status != 200:
        raise ValueError(f"{endpoint.host}:{endpoint.port}/v1/models answered {status}: {models}")
    endpoint = Endpoint(endpoint.host, endpoint.port, models["data"][0]["id"], endpoint.api_key)
    rng = random.Random(0)
    text = " ".join("".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9))) for _ in range(400))
    status, answer = await request_json(endpoint, "POST", "/tokenize", {"model": endpoint.model, "prompt": text})
    if status != 200:
        raise ValueError(f"bench serve draws its prompts' token ids from the server's /tokenize, which answered "
                         f"{status}: {answer}")
    return endpoint, sorted(set(answer["tokens"]))


def _figures(results: list[dict], duration: float, input_len: int) -> dict:
    """vLLM's result fields: counts, throughputs, and each metric's mean, median and p99 in ms."""
    output_tokens = sum(r["num_tokens"] for r in results)
    figures = dict(duration=duration, completed=len(results), total_input_tokens=input_len * len(results),
                   total_output_tokens=output_tokens, request_throughput=len(results) / duration,
                   output_throughput=output_tokens / duration,
                   total_token_throughput=(input_len * len(results) + output_tokens) / duration)
    times = latencies(results)
    for key, name, _ in METRICS:
        values = times[name] or [float("nan")]
        figures.update({f"mean_{key}_ms": statistics.mean(values), f"median_{key}_ms": statistics.median(values),
                        f"p99_{key}_ms": percentile(values, 99)})
    return figures


def _print_figures(figures: dict, endpoint: Endpoint) -> None:
    print(f"{' Serving Benchmark Result ':=^50}")
    rows = [("Model", endpoint.model), ("Successful requests", figures["completed"]),
            ("Benchmark duration (s)", f"{figures['duration']:.2f}"),
            ("Total input tokens", figures["total_input_tokens"]),
            ("Total generated tokens", figures["total_output_tokens"]),
            ("Request throughput (req/s)", f"{figures['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{figures['output_throughput']:.2f}"),
            ("Total Token throughput (tok/s)", f"{figures['total_token_throughput']:.2f}")]
    for label, value in rows:
        print(f"{label + ':':<40} {value:<10}")
    for key, name, title in METRICS:
        print(f"{title:-^50}")
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
            print(f"{f'{label} {name} (ms):':<40} {figures[f'{stat}_{key}_ms']:<10.2f}")
    print("=" * 50)
