"""The CPU's prefill attention kernel (kernels/cpu/prefill_attention.cpp) against what it replaced: the torch
backend's attend(), torch's SDPA on [1, heads, tokens, head_dim] views, in one process, alternating. The kernel
writes into one output allocated once, as the engine's step gives it its rows; SDPA allocates its own.

Each case is one prompt chunk of one layer: --cases LEN_QxLEN_K (a chunk of LEN_Q queries, the last of LEN_K
positions: LEN_Q < LEN_K is a chunk over a cached prefix), with --heads query heads and --kv-heads KV heads of
--head-dim, float32 (--dtype). Both run on one thread and on every thread of the process. Reported: the median µs
of each over --rounds alternating rounds of --calls calls, SDPA's time over the kernel's, and the largest
difference between the two outputs.

    .venv/bin/python benchmarks/bench_prefill_attention.py                    # Qwen3-0.6B's shape: 16 x 8 x 128
    .venv/bin/python benchmarks/bench_prefill_attention.py --heads 4 --kv-heads 2 --head-dim 32   # the tiny model
    .venv/bin/python benchmarks/bench_prefill_attention.py --quick             # seconds: small cases, 3 rounds
"""
import argparse
import statistics
import time

import torch

from tpengine.attention.backend import AttentionParams
from tpengine.attention.torch_backend import attend
from tpengine.bench.quick import parse_with_quick
from tpengine.kernels.cpu import prefill_attention as kernel


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", default=["256x256", "512x512", "64x512", "1024x1024", "2048x2048"],
                   help="LEN_QxLEN_K chunks (default: prompts of 256 to 2048 tokens, and 64 after 448 cached; the "
                        "cpu backend runs the kernel over at most 512 keys)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--window", type=int, default=0, help="a sliding window (default none)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=5)
    return parse_with_quick(p, argv, dict(cases=["64x64", "16x80"], heads=4, kv_heads=2, head_dim=32, rounds=3,
                                          calls=2))


def run_case(len_q: int, len_k: int, args) -> tuple[float, float, float]:
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(len_q + len_k)
    q = torch.randn(len_q, args.heads, args.head_dim, generator=generator).to(dtype)
    k, v = (torch.randn(len_k, args.kv_heads, args.head_dim, generator=generator).to(dtype) for _ in range(2))
    params = AttentionParams(scale=args.head_dim ** -0.5, sliding_window=args.window or None)
    out = torch.empty_like(q)
    runs = [lambda: attend(q, k, v, 0, params), lambda: kernel.prefill_attention(q, k, v, params.scale, args.window, out=out)]
    difference = (runs[0]().float() - runs[1]().float()).abs().max().item()
    times = [[], []]
    for round_ in range(args.rounds):
        for i in ((0, 1) if round_ % 2 else (1, 0)):  # alternate which goes first
            started = time.perf_counter()
            for _ in range(args.calls):
                runs[i]()
            times[i].append((time.perf_counter() - started) / args.calls * 1e6)
    return statistics.median(times[0]), statistics.median(times[1]), difference


def main(argv=None) -> None:
    args = parse_args(argv)
    if not kernel.takes(torch.empty(1, 1, args.head_dim, dtype=getattr(torch, args.dtype))):
        raise SystemExit(f"the kernel does not run head_dim {args.head_dim} in {args.dtype} here "
                         f"(a multiple of {kernel.vector_width()} and a C++ compiler are needed)")
    print(f"{args.heads} query heads, {args.kv_heads} KV heads of {args.head_dim}, {args.dtype}, window "
          f"{args.window or 'none'}; median of {args.rounds} alternating rounds of {args.calls} calls\n")
    print("| threads | chunk (queries x keys) | SDPA µs | kernel µs | SDPA / kernel | max difference |")
    print("|---:|---|---:|---:|---:|---:|")
    every = torch.get_num_threads()
    for threads in sorted({1, every}):
        torch.set_num_threads(threads)
        for case in args.cases:
            len_q, len_k = map(int, case.split("x"))
            sdpa, ours, difference = run_case(len_q, len_k, args)
            print(f"| {threads} | {len_q} x {len_k} | {sdpa:,.0f} | {ours:,.0f} | {sdpa / ours:.2f} | {difference:.1e} |",
                  flush=True)
    torch.set_num_threads(every)


if __name__ == "__main__":
    main()
