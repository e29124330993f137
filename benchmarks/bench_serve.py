"""Serving benchmark: `tpengine serve` under load against offline `LLM.generate`, same workload, same run.

A server alone, at fixed lengths, is `tpengine bench serve`; both load it with tpengine/bench/client.py.

Like vLLM's serving benchmark: requests with random prompt token ids and random prompt and
output lengths (ignore_eos, so each writes exactly its max_tokens) are sent to /v1/completions
as streams, all at once (--request-rate inf, the default: saturation) or with Poisson arrivals at
a rate. Per request the client records the time to the first token (TTFT), the gaps between
streamed chunks (inter-token latency, ITL) and the end-to-end latency; output tok/s is all output
tokens over the time from the first request sent to the last token received. Meanwhile a poller
times GET /health (it must never wait for a step), and after the load the server's CPU use
while idle is read from /proc (over --idle-seconds).

The baseline is the same workload through `LLM.generate` in this process (all requests at once,
with the same engine settings), timed before the server starts, so the two never share the cores.
The load generator is a minimal asyncio HTTP client (no client library), so its own CPU cost
stays small next to the server's on a small machine; it runs on the same host as the server.

On a machine that other work shares, run it with OMP_WAIT_POLICY=PASSIVE (the server inherits it):
with more runnable threads than cores, OpenMP's spinning waits made one side or the other up to 10x
slower at random, which says nothing about the server.

The model is bench.py's random-weight CPU Qwen3 (or --model), without a tokenizer: prompts go as
token ids and tokens are counted from the stream's token_ids (vLLM's return_token_ids).

    .venv/bin/python benchmarks/bench_serve.py                          # saturation, 64 requests
    .venv/bin/python benchmarks/bench_serve.py --request-rate 4         # Poisson arrivals, 4 req/s
    .venv/bin/python benchmarks/bench_serve.py --model /path/to/Qwen3-0.6B --device cuda --num-prompts 256
    .venv/bin/python benchmarks/bench_serve.py --quick                  # seconds: 4 requests, tpengine.bench's QUICK_MODEL

Side by side with vLLM (--vllm-bin, the bin folder ../shared/bench/vllm-cpu/setup.sh prints): both servers
run the same checkpoint (float32, the same max-model-len) and stay up, each started alone (neither's start-up
runs beside the other's) and the other paused (SIGSTOP) while one is measured (class Paused); each round sends
the same requests (a fresh seed per round, so no round hits a prefix cache an earlier one filled) to each server in turn,
the order rotating, and the table gives every round and each server's median. TPOT is per request:
(last token - first token) / (output tokens - 1), as vLLM's client computes it. --client vllm measures
with `vllm-cli bench serve` (its random dataset at --max-input-len in / --max-output-len out, its Poisson
arrivals; results read from its JSON) instead of the minimal client. Without --vllm-bin (or if its vllm-cli is missing) the same rounds measure tpengine alone.
--tiny-model serves the embedded tiny Qwen3 with its byte tokenizer, which vLLM's server and client need.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_serve.py --tiny-model --vllm-bin ~/.cache/vllm-cpu-anchor/bin \
        --client vllm --max-model-len 4096 --min-input-len 256 --max-input-len 256 --min-output-len 64 \
        --max-output-len 64 --request-rate 8 --num-prompts 64 --repeat 3
    .venv/bin/python benchmarks/bench_serve.py --tiny-model --side-by-side --request-rate 8   # tpengine alone, same rounds
"""
import argparse
import asyncio
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from tpengine.bench import client
from tpengine.bench.client import Endpoint, free_port, latencies, wait_ready
from tpengine.bench.models import QUICK_MODEL, write_model
from tpengine.bench.quick import parse_with_quick
from tpengine.bench.workload import RandomWorkload, percentile


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint folder of a supported family (default: bench.py's random-weight model, written to a temp folder)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--min-input-len", type=int, default=16)
    p.add_argument("--max-input-len", type=int, default=256)
    p.add_argument("--min-output-len", type=int, default=16)
    p.add_argument("--max-output-len", type=int, default=128)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals; inf sends all at once (default)")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-offline", action="store_true", help="measure the server only")
    p.add_argument("--repeat", type=int, default=1,
                   help="alternate offline and server runs this many times and keep each side's fastest (noisy machines); "
                        "side by side: rounds")
    p.add_argument("--tiny-model", action="store_true",
                   help="serve the embedded tiny Qwen3 with its byte tokenizer (what `tpengine make-tiny-model` writes)")
    p.add_argument("--side-by-side", action="store_true",
                   help="keep the server(s) up and measure rounds side by side (implied by --vllm-bin); no offline run")
    p.add_argument("--vllm-bin", help="vLLM's bin folder (with vllm-cli): serve the same model with vLLM too")
    p.add_argument("--client", choices=("builtin", "vllm"), default="builtin",
                   help="vllm: `vllm-cli bench serve` from --vllm-bin, random dataset (default builtin)")
    p.add_argument("--max-model-len", type=int, help="both servers' (default: the longest request)")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="one more flag for `tpengine serve`, e.g. --serve-arg=--max-num-seqs=512 (repeatable)")
    p.add_argument("--idle-seconds", type=float, default=5.0, help="how long the server's idle CPU is read (default 5)")
    # vLLM's random dataset makes each prompt a rotation of one cyclic run of the vocabulary: on a small vocabulary
    # (the tiny model's 320) later rounds find earlier rounds' prompts cached, so each round ran faster than the last
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="both servers without prefix caching, so no round reuses another's prompts")
    args = parse_with_quick(p, argv, dict(num_prompts=4, min_input_len=4, max_input_len=24, min_output_len=2,
                                          max_output_len=8, idle_seconds=1.0), "tpengine.bench's QUICK_MODEL")
    args.side_by_side = args.side_by_side or args.vllm_bin is not None
    if args.client == "vllm" and args.vllm_bin is None:
        p.error("--client vllm needs --vllm-bin")
    return args


def make_workload(args, vocab_size: int = 10_000) -> tuple[list[list[int]], list[int]]:
    workload = RandomWorkload(args.num_prompts, args.min_input_len, args.max_input_len, args.min_output_len,
                              args.max_output_len)
    return workload.draw(vocab_size, args.seed)


def max_model_len(args) -> int:
    return args.max_model_len or args.max_input_len + args.max_output_len


def engine_flags(args) -> dict:
    return dict(tensor_parallel_size=args.tp, device=args.device, max_model_len=max_model_len(args),
                enable_prefix_caching=not args.no_prefix_caching)


# --- offline baseline -------------------------------------------------------------------------------

def time_offline(args, model: str, prompts, output_lens) -> float:
    from tpengine import LLM, SamplingParams
    with LLM(model, **engine_flags(args)) as llm:
        llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
        params = [SamplingParams(temperature=args.temperature, max_tokens=n, ignore_eos=True) for n in output_lens]
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - started
    assert [len(out.outputs[0].token_ids) for out in outputs] == output_lens
    return elapsed


# --- the server and a minimal streaming client ------------------------------------------------------

def start_server(args, model: str, port: int) -> subprocess.Popen:
    return client.start_server(port, ["--model", model, "--served-model-name", "bench", "--tp", str(args.tp),
                                      "--device", args.device, "--max-model-len", str(max_model_len(args)),
                                      *(["--dtype", "float32"] if args.device == "cpu" else []),
                                      *(["--no-enable-prefix-caching"] if args.no_prefix_caching else []),
                                      *args.serve_arg])


def start_vllm(args, model: str, port: int) -> subprocess.Popen:
    """vLLM's server on the same checkpoint, as ../shared/bench/vllm-cpu/README.md runs it (its own venv)."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"))
    preload = ["/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
               os.path.join(os.path.dirname(os.path.abspath(args.vllm_bin)), "lib", "libiomp5.so")]
    if args.device == "cpu" and all(os.path.exists(path) for path in preload):
        env["LD_PRELOAD"] = ":".join(preload)
    command = [os.path.join(args.vllm_bin, "vllm-cli"), "serve", model, "--port", str(port),
               "--served-model-name", "bench", "--max-model-len", str(max_model_len(args)),
               "--tensor-parallel-size", str(args.tp), *(["--dtype", "float32"] if args.device == "cpu" else []),
               "--disable-uvicorn-access-log", *(["--no-enable-prefix-caching"] if args.no_prefix_caching else [])]
    return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env)


def endpoint(port: int) -> Endpoint:
    return Endpoint("127.0.0.1", port, "bench")


def run_load(args, port: int, prompts, output_lens, warm_up: bool = True) -> tuple[list[dict], float, list[float]]:
    return asyncio.run(client.run_load(endpoint(port), prompts, output_lens, args.temperature, args.request_rate,
                                       args.seed, warm_up=warm_up))


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_server(args, model: str, prompts, output_lens):
    """Start a server, run the load, read its idle CPU, stop it: (results, seconds, /health latencies,
    idle CPU fraction, exit status)."""
    port = free_port()
    server = start_server(args, model, port)
    try:
        wait_ready(endpoint(port), server)
        results, elapsed, health = run_load(args, port, prompts, output_lens)
        time.sleep(1.0)
        idle_start = cpu_seconds(server.pid)
        time.sleep(args.idle_seconds)
        idle_cpu = (cpu_seconds(server.pid) - idle_start) / args.idle_seconds
    finally:
        server.send_signal(signal.SIGTERM)
        exit_status = server.wait(timeout=60)
    return results, elapsed, health, idle_cpu, exit_status


# --- side by side: tpengine and vLLM kept up, the same rounds against each -----------------------

METRICS = ("TTFT", "TPOT", "ITL", "E2EL")


def bench_model(args, folder: str) -> str:
    """--model, the tiny model with its tokenizer (--tiny-model), or bench.py's random-weight model, in folder."""
    if args.model:
        return args.model
    if args.tiny_model:
        from tpengine.tiny_model import write_tiny_model
        return write_tiny_model(os.path.join(folder, "tiny"))
    return write_model(args.device, folder, QUICK_MODEL if args.quick else None)


def vocab_size(model: str) -> int:
    with open(os.path.join(model, "config.json")) as f:
        return json.load(f)["vocab_size"]


def builtin_round(args, port: int, seed: int, model: str) -> dict:
    """One load from the minimal client: output tok/s and (p50, p99) ms of each metric."""
    round_args = argparse.Namespace(**{**vars(args), "seed": seed})
    prompts, output_lens = make_workload(round_args, vocab_size(model))
    results, elapsed, _ = run_load(round_args, port, prompts, output_lens, warm_up=False)
    if [r["num_tokens"] for r in results] != output_lens:
        raise SystemExit("a server wrote other lengths than asked")
    times = latencies(results)
    return {"tok/s": sum(output_lens) / elapsed,
            **{name: (percentile(times[name], 50), percentile(times[name], 99)) for name in METRICS}}


def vllm_client_round(args, port: int, seed: int, model: str) -> dict:
    """One `vllm-cli bench serve` run (random dataset, fixed lengths: the max ones): its own figures."""
    with tempfile.TemporaryDirectory() as folder:
        command = [os.path.join(args.vllm_bin, "vllm-cli"), "bench", "serve", "--backend", "openai",
                   "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions", "--model", "bench",
                   "--tokenizer", model, "--dataset-name", "random", "--random-input-len", str(args.max_input_len),
                   "--random-output-len", str(args.max_output_len), "--ignore-eos",
                   "--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate),
                   "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
                   "--save-result", "--result-dir", folder, "--result-filename", "result.json"]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(os.path.join(folder, "result.json")) as f:
            result = json.load(f)
    if result.get("failed"):
        raise SystemExit(f"{result['failed']} requests failed on port {port}")
    return {"tok/s": result["output_throughput"],
            **{name: (result[f"p50_{name.lower()}_ms"], result[f"p99_{name.lower()}_ms"]) for name in METRICS}}


def process_tree(pid: int) -> list[int]:
    """pid and every process below it (vLLM's engine core and workers), parents first."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:  # the parent pid follows the command name's closing ')'
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # it ended while we looked
    tree = [pid]
    for member in tree:
        tree += [child for child, parent in parents.items() if parent == member]
    return tree


class Paused:
    """The servers not being measured, stopped (SIGSTOP) for a round and resumed after: an idle server is not
    idle to the one measured. vLLM's polls woke ~1,500 times a second, and each wake-up on a core held one of
    tpengine's compute threads back at its next barrier: tpengine's throughput fell ~20% beside an idle vLLM."""

    def __init__(self, processes: list[subprocess.Popen]):
        self.pids = [pid for process in processes for pid in process_tree(process.pid)]

    def _signal(self, sig: int, pids: list[int]) -> None:
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def __enter__(self):
        self._signal(signal.SIGSTOP, self.pids[::-1])

    def __exit__(self, *exc):
        self._signal(signal.SIGCONT, self.pids)


def side_by_side(args) -> None:
    has_vllm = args.vllm_bin is not None and os.access(os.path.join(args.vllm_bin, "vllm-cli"), os.X_OK)
    if args.vllm_bin is not None and not has_vllm:
        print(f"no vllm-cli in {args.vllm_bin}: measuring tpengine alone")
    measure = vllm_client_round if args.client == "vllm" and has_vllm else builtin_round
    client_name = "vllm bench serve" if measure is vllm_client_round else "minimal asyncio client"
    print(f"$ {shlex.join([os.path.basename(sys.executable), *sys.argv])}")
    print(f"{platform.machine()}, {os.cpu_count()} cores, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}, "
          f"load average before {os.getloadavg()[0]:.2f}; client: {client_name}; {args.num_prompts} requests a round, "
          f"request rate {args.request_rate}, tp={args.tp}, max-model-len {max_model_len(args)}")
    servers: dict[str, tuple[int, subprocess.Popen]] = {}
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        model = bench_model(args, folder)
        try:
            # one start-up at a time: neither's (tpengine's warm-up measurements, vLLM's compiles) runs beside the other
            for name, start in (("tpengine", start_server), ("vLLM", start_vllm))[:2 if has_vllm else 1]:
                port, started = free_port(), time.monotonic()
                servers[name] = port, start(args, model, port)
                wait_ready(endpoint(port), servers[name][1])
                print(f"{name}: healthy {time.monotonic() - started:.1f} s after its start")
            for name, (port, process) in servers.items():
                measure(args, port, args.seed + 10_000, model)  # warm-up: its own prompts, not timed
            for round_index in range(args.repeat):
                names = list(servers)
                names = names[round_index % len(names):] + names[:round_index % len(names)]  # who goes first rotates
                for name in names:
                    with Paused([process for other, (_, process) in servers.items() if other != name]):
                        figures = measure(args, servers[name][0], args.seed + round_index, model)
                    rows.append((round_index + 1, name, figures, os.getloadavg()[0]))
        finally:
            for port, process in servers.values():
                process.send_signal(signal.SIGINT)
            for port, process in servers.values():
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    process.kill()
    print("\n| round | server | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p50 / p99 ms "
          "| E2EL p50 / p99 ms | load after |\n|---:|---|---:|---:|---:|---:|---:|---:|")
    for round_number, name, figures, load in rows:
        cells = " | ".join(f"{figures[m][0]:,.1f} / {figures[m][1]:,.1f}" for m in METRICS)
        print(f"| {round_number} | {name} | {figures['tok/s']:,.1f} | {cells} | {load:.2f} |")
    for name in servers:
        mine = [figures for _, who, figures, _ in rows if who == name]
        cells = " | ".join(f"{statistics.median(f[m][0] for f in mine):,.1f} / "
                           f"{statistics.median(f[m][1] for f in mine):,.1f}" for m in METRICS)
        print(f"| median | {name} | {statistics.median(f['tok/s'] for f in mine):,.1f} | {cells} | |")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.side_by_side:
        return side_by_side(args)
    folder = tempfile.TemporaryDirectory()
    model = bench_model(args, folder.name)
    prompts, output_lens = make_workload(args, vocab_size(model))
    num_output = sum(output_lens)
    print(f"$ {shlex.join([os.path.basename(sys.executable), *sys.argv])}")
    print(f"{platform.machine()}, {os.cpu_count()} cores, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}, "
          f"load average before "
          f"{os.getloadavg()[0]:.2f}; {args.num_prompts} requests, {sum(map(len, prompts))} prompt and "
          f"{num_output} output tokens, request rate {args.request_rate}, tp={args.tp}")
    offline_runs, server_runs = [], []
    with folder:
        for _ in range(args.repeat):
            if not args.skip_offline:
                offline_runs.append(time_offline(args, model, prompts, output_lens))
            server_runs.append(run_server(args, model, prompts, output_lens))
    offline_s = min(offline_runs) if offline_runs else None
    results, elapsed, health, idle_cpu, exit_status = min(server_runs, key=lambda run: run[1])
    print("rounds: offline " + ", ".join(f"{s:.2f} s" for s in offline_runs) + "; server "
          + ", ".join(f"{run[1]:.2f} s" for run in server_runs))
    assert [r["num_tokens"] for r in results] == output_lens, "the server wrote other lengths than asked"
    times = latencies(results)
    ttft = times["TTFT"]
    print(f"\n| measure | server | offline LLM.generate |\n|---|---:|---:|")
    offline_rate = f"{num_output / offline_s:,.1f}" if offline_s else "-"
    print(f"| output tok/s | {num_output / elapsed:,.1f} | {offline_rate} |")
    print(f"| wall time | {elapsed:.2f} s | {f'{offline_s:.2f} s' if offline_s else '-'} |")
    for name, key in (("TTFT", "TTFT"), ("time per output token", "TPOT"), ("inter-token latency", "ITL"),
                      ("end-to-end latency", "E2EL")):
        values = times[key]
        print(f"| {name} p50 / p99 | {percentile(values, 50):,.1f} / {percentile(values, 99):,.1f} ms | |")
    print(f"| GET /health under load p50 / p99 / max | {percentile(health, 50) * 1e3:.1f} / "
          f"{percentile(health, 99) * 1e3:.1f} / {max(health) * 1e3:.1f} ms ({len(health)} polls) | |")
    print(f"| server CPU while idle ({args.idle_seconds:g} s) | {idle_cpu * 100:.1f}% of a core | |")
    if offline_s:
        print(f"\nserver / offline throughput: {offline_s / elapsed:.3f} (the server loses "
              f"{(1 - offline_s / elapsed) * 100:.1f}%)")
    print(f"server exit status after SIGTERM: {exit_status}; load average after {os.getloadavg()[0]:.2f}; "
          f"TTFT mean {statistics.mean(ttft):,.1f} ms")


if __name__ == "__main__":
    main()
