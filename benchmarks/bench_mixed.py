"""Inter-token latency and throughput with requests arriving over time: mixed steps vs prefill-first.

Requests arrive as a Poisson process (exponential gaps at --rate requests/s, seeded): most with short
prompts, every --long-every-th with a long one; each writes max_tokens drawn from a range
(ignore_eos, greedy). The engine is driven offline through add_request/step on wall-clock time:
before each step, every request whose arrival time has passed is added. A token's time is the end
of the step that produced it; inter-token latency (ITL) is the gap between consecutive tokens of
one request (its first token excluded: that is time to first token, also reported). Throughput
is output tokens over the time from the first arrival to the last token.

Both policies run on the same model, arrivals and prompts in the same process, alternating
(--repeat rounds, the order flipped each round); every round's numbers are printed and the
table shows the median of the rounds for each. The model is bench.py's CPU shape (random weights).

    .venv/bin/python benchmarks/bench_mixed.py
    .venv/bin/python benchmarks/bench_mixed.py --rate 4 --num-requests 48 --repeat 3
    .venv/bin/python benchmarks/bench_mixed.py --quick     # seconds: 6 requests on tpengine.bench's QUICK_MODEL
"""
import argparse
import os
import random
import statistics
import sys
import tempfile
import time

import torch

from tpengine.bench.models import QUICK_MODEL, write_model
from tpengine.bench.quick import parse_with_quick
from tpengine.bench.results import git_revision, load_average, machine_line


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint folder of a supported family (default: bench.py's random-weight CPU shape)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--num-requests", type=int, default=40)
    p.add_argument("--rate", type=float, default=3.0, help="mean arrivals per second (default 3)")
    p.add_argument("--short-input-len", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"))
    p.add_argument("--long-input-len", type=int, nargs=2, default=[1500, 3000], metavar=("MIN", "MAX"))
    p.add_argument("--long-every", type=int, default=5, help="every n-th request has a long prompt (default 5)")
    p.add_argument("--output-len", type=int, nargs=2, default=[32, 96], metavar=("MIN", "MAX"))
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="(default: the device's)")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    # long prompts 3x the step's token budget, so mixed steps chunk them and prefill-first steps stall decodes
    return parse_with_quick(p, argv, dict(num_requests=6, rate=20.0, short_input_len=[4, 16], long_input_len=[48, 96],
                                          long_every=3, output_len=[2, 6], max_num_batched_tokens=32, repeat=1),
                            "tpengine.bench's QUICK_MODEL")


def make_workload(args):
    rng = random.Random(args.seed)
    arrivals, requests, t = [], [], 0.0
    for i in range(args.num_requests):
        low, high = args.long_input_len if (i + 1) % args.long_every == 0 else args.short_input_len
        requests.append(([rng.randrange(10, 10000) for _ in range(rng.randint(low, high))],
                         rng.randint(*args.output_len)))
        arrivals.append(t)
        t += rng.expovariate(args.rate)
    return arrivals, requests


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


def run(args, model: str, policy: str, arrivals, requests) -> dict:
    from tpengine import LLM, SamplingParams
    max_len = max(len(p) for p, _ in requests) + max(n for _, n in requests)
    llm = LLM(model, device=args.device, scheduling_policy=policy, max_model_len=max_len,
              max_num_batched_tokens=args.max_num_batched_tokens)
    try:
        llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        token_times: dict[int, list[float]] = {}
        arrival_of: dict[int, float] = {}
        pending = list(range(len(requests)))
        start = time.perf_counter()
        while pending or llm.has_unfinished_requests():
            now = time.perf_counter() - start
            while pending and arrivals[pending[0]] <= now:
                i = pending.pop(0)
                prompt, max_tokens = requests[i]
                rid = llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
                arrival_of[rid] = arrivals[i]
                token_times[rid] = []
            if not llm.has_unfinished_requests():
                time.sleep(max(0.0, arrivals[pending[0]] - now))
                continue
            outputs = llm.step()
            now = time.perf_counter() - start
            for output in outputs:
                times = token_times[output.request_id]
                times.extend([now] * (len(output.token_ids) - len(times)))
        end = time.perf_counter() - start
    finally:
        llm.shutdown()
    itl = [b - a for times in token_times.values() for a, b in zip(times, times[1:])]
    ttft = [times[0] - arrival_of[rid] for rid, times in token_times.items()]
    num_tokens = sum(len(times) for times in token_times.values())
    assert num_tokens == sum(n for _, n in requests), "some request wrote other lengths than asked"
    return dict(itl_p50=percentile(itl, 50) * 1e3, itl_p99=percentile(itl, 99) * 1e3,
                ttft_p50=percentile(ttft, 50), tok_s=num_tokens / (end - arrivals[0]))


def main(argv=None):
    args = parse_args(argv)
    load_before = load_average()
    arrivals, requests = make_workload(args)
    policies = ["mixed", "prefill_first"]
    results = {policy: [] for policy in policies}
    with tempfile.TemporaryDirectory(prefix="tpengine-bench-") as tmp:
        model = args.model or write_model(args.device, os.path.join(tmp, "model"), QUICK_MODEL if args.quick else None)
        for round_ in range(args.repeat):
            for policy in policies[::1 if round_ % 2 == 0 else -1]:
                r = run(args, model, policy, arrivals, requests)
                results[policy].append(r)
                print(f"[round {round_ + 1}/{args.repeat}] {policy}: ITL p50 {r['itl_p50']:.0f} ms, p99 "
                      f"{r['itl_p99']:.0f} ms, TTFT p50 {r['ttft_p50']:.2f} s, {r['tok_s']:.1f} output tok/s, "
                      f"load {load_average()}", file=sys.stderr)
    num_long = sum(1 for i in range(args.num_requests) if (i + 1) % args.long_every == 0)
    print(f"\ncommand: `{' '.join(['benchmarks/bench_mixed.py', *(argv or sys.argv[1:])])}`")
    print(f"machine: {machine_line(args.device, torch.get_num_threads())}")
    print(f"load average (1/5/15 min): {load_before} before, {load_average()} after; revision {git_revision()}")
    print(f"workload: {args.num_requests} requests at {args.rate}/s (Poisson, seed {args.seed}), {num_long} with "
          f"prompts of {args.long_input_len[0]}..{args.long_input_len[1]} tokens, the rest "
          f"{args.short_input_len[0]}..{args.short_input_len[1]}; outputs {args.output_len[0]}..{args.output_len[1]}; "
          f"median of {args.repeat} alternating rounds\n")
    print("| policy | ITL p50 (ms) | ITL p99 (ms) | TTFT p50 (s) | output tok/s |")
    print("|---|---|---|---|---|")
    for policy, rounds in results.items():
        med = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
        print(f"| {policy} | {med['itl_p50']:.0f} | {med['itl_p99']:.0f} | {med['ttft_p50']:.2f} | {med['tok_s']:.1f} |")


if __name__ == "__main__":
    main()
