"""The CPU mixture-of-experts layer: tokens grouped by expert against a per-token reference, in one run.

One sparse layer's experts, Qwen3-30B-A3B-shaped by default (hidden 2048, 128 experts, top-8, expert
intermediate 768, float32, one rank): routing from random router logits, then
  - grouped (tpengine.platforms.torch_ops.grouped_experts, what the engine runs on the CPU): each chosen
    expert's two matmuls once over its tokens;
  - per token (per_token_experts): each token's k experts one matmul pair at a time.
Both give the same sum (checked here). Prints a markdown table for docs/benchmarks.md.

    .venv/bin/python benchmarks/bench_moe.py [--experts 128 --top-k 8 --hidden 2048 --intermediate 768]
    .venv/bin/python benchmarks/bench_moe.py --quick      # seconds: 8 experts, top-2, hidden 64
"""
import argparse
import time

import torch

from tpengine.bench.quick import parse_with_quick
from tpengine.layers.fused_moe import per_token_experts, select_experts
from tpengine.platforms.torch_ops import grouped_experts


def best_ms(fn, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times) * 1e3


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = parse_with_quick(p, argv, dict(experts=8, top_k=2, hidden=64, intermediate=32, tokens=[1, 8], rounds=1))
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    w13 = torch.randn(args.experts, 2 * args.intermediate, args.hidden) / args.hidden ** 0.5
    w2 = torch.randn(args.experts, args.hidden, args.intermediate) / args.intermediate ** 0.5
    print(f"\n## MoE layer on the CPU: {args.experts} experts, top-{args.top_k}, hidden {args.hidden}, "
          f"expert intermediate {args.intermediate}, float32, {torch.get_num_threads()} threads\n")
    print("| tokens | experts used | per-token ms | grouped ms | speed-up |\n|---:|---:|---:|---:|---:|")
    for num_tokens in args.tokens:
        x = torch.randn(num_tokens, args.hidden)
        weights, ids = select_experts(torch.randn(num_tokens, args.experts), args.top_k, renormalize=True)
        grouped = grouped_experts(x, w13, w2, weights, ids)
        reference = per_token_experts(x, w13, w2, weights, ids)
        assert torch.allclose(grouped, reference, rtol=1e-4, atol=1e-4), "grouped and per-token sums differ"
        per_token_ms = best_ms(lambda: per_token_experts(x, w13, w2, weights, ids), args.rounds)
        grouped_ms = best_ms(lambda: grouped_experts(x, w13, w2, weights, ids), args.rounds)
        print(f"| {num_tokens} | {ids.unique().numel()} | {per_token_ms:.1f} | {grouped_ms:.1f} "
              f"| {per_token_ms / grouped_ms:.2f}x |")


if __name__ == "__main__":
    main()
