"""Data parallelism on one machine: N replicas behind vLLM's router against one replica with all the cores,
on a prefix-heavy workload; and the router's cache_aware policy against round_robin.

The workload: --num-groups "system prompts" of --prefix-len characters (the byte tokenizer makes a character a
token), each followed by --requests-per-group questions of their own (30-90 characters), in a seeded random
order, --max-tokens output tokens each (greedy, ignore_eos), sent as text to /v1/completions by
--concurrency client threads. Three servers run it in turn, each started fresh (empty caches) and warmed up on
an unrelated prompt before the clock starts:

- 1 replica: `tpengine serve` alone, its threads on all --num-cores cores (the baseline);
- N replicas, cache_aware: `tpengine serve --data-parallel-size N`, each replica pinned to its share of the
  cores, the router sending a prompt to the replica whose cache most likely holds its prefix;
- N replicas, round_robin: the same, the router sending requests to each replica in turn.

The setups run in turn --repeat times (the order rotating each round), each time on a fresh server; each
setup's fastest run is kept, as on a machine other work shares the slower ones measure that work.

Output tok/s is the output tokens over the wall time from the first request sent to the last answer. The
prefix-cache hit rate is the replicas' tpengine:prefix_cache_hits over tpengine:prefix_cache_queries (prompt
tokens looked up) during the run, summed over replicas; prompt tokens computed = queries - hits.

    .venv/bin/python benchmarks/bench_data_parallel.py                 # 2 replicas, 8 groups x 16 requests, 2 rounds
    .venv/bin/python benchmarks/bench_data_parallel.py --quick         # seconds: 3 groups x 3 requests, tiny model
"""
import argparse
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from tpengine.bench.quick import parse_with_quick
from tpengine.bench.results import Record, add_json_flag, git_revision, load_average

# Big enough that a 1,000-token prefix costs a CPU real time to compute, small enough that the run takes minutes.
MODEL = dict(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, tie_word_embeddings=True,
             initializer_range=0.02)
QUICK_MODEL = dict(MODEL, hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16)
START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 30.0
WORDS = ("cache", "replica", "router", "prefix", "token", "block", "engine", "request", "latency", "batch")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-replicas", type=int, default=2, help="replicas behind the router (default 2)")
    parser.add_argument("--num-cores", type=int, default=None,
                        help="cores the servers may use (default: all of this process's)")
    parser.add_argument("--num-groups", type=int, default=8, help="distinct shared prefixes (default 8)")
    parser.add_argument("--requests-per-group", type=int, default=16, help="requests sharing each (default 16)")
    parser.add_argument("--prefix-len", type=int, default=1000,
                        help="characters (tokens) of each prefix (default 1000)")
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (default 32)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight at once (default 16)")
    parser.add_argument("--block-size", type=int, default=16, help="KV-cache block size (default 16)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument("--repeat", type=int, default=2,
                        help="rounds over the setups; each keeps its fastest (default 2)")
    add_json_flag(parser)
    args = parse_with_quick(parser, argv, dict(num_groups=3, requests_per_group=3, prefix_len=200, max_tokens=4,
                                               concurrency=4, repeat=1), note="a 2-layer hidden-64 model")
    for name in ("num_replicas", "num_groups", "requests_per_group", "prefix_len", "max_tokens", "concurrency",
                 "repeat"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    available = len(os.sched_getaffinity(0))
    args.num_cores = args.num_cores or available
    if not args.num_replicas <= args.num_cores <= available:
        raise ValueError(f"--num-cores must be between --num-replicas ({args.num_replicas}) and the {available} "
                         f"cores this process may use, got {args.num_cores}")
    return args


def random_text(rng: random.Random, num_chars: int) -> str:
    words = []
    while sum(map(len, words)) < num_chars:
        words.append(rng.choice(WORDS) + " ")
    return "".join(words)[:num_chars]


def workload(args) -> list[str]:
    rng = random.Random(args.seed)
    prefixes = [(f"Group {g}: " + random_text(rng, args.prefix_len))[:args.prefix_len] for g in range(args.num_groups)]
    prompts = [prefix + f"Question {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10)))
               for prefix in prefixes for i in range(args.requests_per_group)]
    rng.shuffle(prompts)
    return prompts


class Deployment:
    """A `tpengine serve` (with --data-parallel-size, a router in front) started in its own session."""

    def __init__(self, model: str, args, cores: list[int], *flags: str):
        from tpengine.distributed.parallel_state import find_free_port
        self.port = find_free_port()
        command = [sys.executable, "-m", "tpengine.cli", "serve", "--model", model, "--port", str(self.port),
                   "--served-model-name", "bench", "--block-size", str(args.block_size), "--max-model-len", "2048",
                   "--quiet", "--disable-access-log", *flags]
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, start_new_session=True,
                                        stdout=subprocess.DEVNULL)
        os.sched_setaffinity(self.process.pid, cores)  # before its threads start; replicas split these cores
        deadline = time.monotonic() + START_TIMEOUT_S
        while request(self.port, "GET", "/health")[0] != 200:
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"`{' '.join(command)}` did not become ready")
            time.sleep(0.2)
        status, body = request(self.port, "GET", "/get_loads")  # the router's list of its replicas
        self.replica_ports = [self.port] if status != 200 else [int(w["worker"].rsplit(":", 1)[1])
                                                                for w in body["workers"]]

    def counters(self) -> tuple[float, float]:
        """(prefix-cache hits, queries) summed over the replicas."""
        from prometheus_client.parser import text_string_to_metric_families
        totals = {"tpengine:prefix_cache_hits_total": 0.0, "tpengine:prefix_cache_queries_total": 0.0}
        for port in self.replica_ports:
            for family in text_string_to_metric_families(request(port, "GET", "/metrics")[1]):
                for sample in family.samples:
                    if sample.name in totals:
                        totals[sample.name] += sample.value
        return totals["tpengine:prefix_cache_hits_total"], totals["tpengine:prefix_cache_queries_total"]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def request(port: int, method: str, path: str, body: dict | None = None, timeout: float = 600.0):
    """(status, the JSON body parsed or the text); status None when nothing answers."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request(method, path, body=None if body is None else json.dumps(body),
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        text = response.read().decode()
    except OSError:
        return None, ""
    finally:
        connection.close()
    try:
        return response.status, json.loads(text)
    except ValueError:
        return response.status, text


def complete(port: int, prompt: str, max_tokens: int) -> int:
    status, body = request(port, "POST", "/v1/completions", dict(model="bench", prompt=prompt, max_tokens=max_tokens,
                                                                 temperature=0.0, ignore_eos=True))
    if status != 200:
        raise RuntimeError(f"a request failed with {status}: {body}")
    return body["usage"]["completion_tokens"]


def measure(name: str, deployment: Deployment, args, prompts: list[str]) -> dict:
    for port in deployment.replica_ports:  # first-use costs (kernels, allocator) out of the timing
        complete(port, "warm up " * 20, 2)
    hits_before, queries_before = deployment.counters()
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
        output_tokens = sum(pool.map(lambda prompt: complete(deployment.port, prompt, args.max_tokens), prompts))
    elapsed = time.perf_counter() - started
    hits, queries = (after - before for after, before in zip(deployment.counters(), (hits_before, queries_before)))
    return dict(setup=name, seconds=elapsed, output_tokens=output_tokens, output_tok_s=output_tokens / elapsed,
                prompt_tokens=queries, prompt_tokens_computed=queries - hits, prefix_cache_hit_rate=hits / queries)


def threads(count: int) -> str:
    return f"{count} thread{'s' if count > 1 else ''}"


def main(argv=None) -> int:
    args = parse_args(argv)
    record = Record("bench_data_parallel", argv)
    from tpengine.tiny_model import write_tiny_model
    cores = sorted(os.sched_getaffinity(0))[:args.num_cores]
    prompts = workload(args)
    n = args.num_replicas
    setups = [(f"1 replica x {threads(len(cores))}", ()),
              *((f"{n} replicas x {threads(len(cores) // n)}, {policy}",
                 ("--data-parallel-size", str(n), "--router-policy", policy))
                for policy in ("cache_aware", "round_robin"))]
    runs: dict[str, list[dict]] = {name: [] for name, _ in setups}
    with tempfile.TemporaryDirectory() as folder:
        model = write_tiny_model(folder, seed=0, **(QUICK_MODEL if args.quick else MODEL))
        for round_index in range(args.repeat):
            for name, flags in setups[round_index % len(setups):] + setups[:round_index % len(setups)]:
                deployment = Deployment(model, args, cores, *flags)
                try:
                    runs[name].append(measure(name, deployment, args, prompts))
                finally:
                    deployment.stop()
    rows = [min(runs[name], key=lambda run: run["seconds"]) for name, _ in setups]
    print(f"# bench_data_parallel: {len(prompts)} requests, {args.num_groups} prefixes of {args.prefix_len} tokens "
          f"x {args.requests_per_group} requests, {args.max_tokens} output tokens each, concurrency "
          f"{args.concurrency}, block size {args.block_size}; fastest of {args.repeat} runs each")
    print(f"# model {'QUICK_MODEL' if args.quick else 'MODEL'}: {json.dumps(QUICK_MODEL if args.quick else MODEL)}")
    print(f"# {len(cores)} cores; revision {git_revision()}; load average {load_average()}")
    print()
    print("| setup | wall s | output tok/s | prompt tokens | computed | prefix-cache hit rate | every run's tok/s |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for row in rows:
        every_run = ", ".join(f"{run['output_tok_s']:,.0f}" for run in runs[row["setup"]])
        print(f"| {row['setup']} | {row['seconds']:.2f} | {row['output_tok_s']:,.0f} | {row['prompt_tokens']:,.0f} | "
              f"{row['prompt_tokens_computed']:,.0f} | {row['prefix_cache_hit_rate']:.1%} | {every_run} |")
    record.write(args.json, rows=rows, runs=runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
