"""The CPU's paged decode attention kernel against an earlier revision's, in one process, alternating.

The earlier kernel is kernels/cpu/paged_decode_attention.cpp as `git show REV:` gives it (default: HEAD~1, or
--baseline-source FILE), built beside this one under another op namespace; both run on the same K/V cache,
block tables and queries, Qwen3-0.6B's attention shape by default (16 query heads, 8 KV heads of 128). Cases:
batch 1 at a short and a long context, and a batch of 16, in bfloat16 and float32, 256-token blocks. Reported:
the median µs of each over --rounds alternating rounds of --calls calls, their ratio, and the largest difference
between the two outputs.

Back-to-back calls find the K/V in the CPU's caches; inside an engine step they come from memory (each layer's
weights pass in between). With --model, the same kernels also run inside an engine's decode steps (the `cpu`
backend's kernel swapped between rounds, the engine, its requests and cache the same): for each --engine-cases
batch of random prompts, the median µs of one attention call within the steps and the median step, per kernel.

    .venv/bin/python benchmarks/bench_decode_attention.py [--baseline REV | --baseline-source FILE]
    .venv/bin/python benchmarks/bench_decode_attention.py --model ~/.cache/tpengine-bench/qwen3_0_6b_model \
        --quantization int4 --engine-cases 1x208 1x2048 16x512
    .venv/bin/python benchmarks/bench_decode_attention.py --quick    # seconds: small cases, 3 rounds, a tiny engine
"""
import argparse
import os
import statistics
import tempfile
import time

import torch

from kernel_baseline import start_baseline  # benchmarks/, this script's folder
from tpengine.bench.quick import parse_with_quick
from tpengine.kernels.cpu.paged_decode_attention import load

SOURCE = "kernels/cpu/paged_decode_attention.cpp"


def run_case(ops, dtype, batch: int, context: int, args) -> tuple[float, float, float]:
    heads, kv_heads, head_dim, block_size = args.heads, args.kv_heads, args.head_dim, 256
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
    tables = torch.randperm(num_blocks).view(batch, blocks_per_seq).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32)
    q = torch.randn(batch, heads, head_dim).to(dtype)
    scale = head_dim ** -0.5
    outs = []
    for op in ops:
        out = torch.empty_like(q)
        op(out, q, k_cache, v_cache, tables, lens, scale, 0, 0.0, None)
        outs.append(out.float())
    times = [[], []]
    for round_ in range(args.rounds):
        order = (0, 1) if round_ % 2 else (1, 0)  # alternate which goes first
        for i in order:
            out = torch.empty_like(q)
            started = time.perf_counter()
            for _ in range(args.calls):
                ops[i](out, q, k_cache, v_cache, tables, lens, scale, 0, 0.0, None)
            times[i].append((time.perf_counter() - started) / args.calls * 1e6)
    return statistics.median(times[0]), statistics.median(times[1]), (outs[0] - outs[1]).abs().max().item()


def engine_rounds(ops, args) -> None:
    """The kernels inside an engine's decode steps (see the docstring)."""
    import random

    import tpengine.attention.cpu_backend as cpu_backend
    from tpengine import LLM, SamplingParams

    call_seconds: list[float] = []

    def timed(op):
        def kernel(q, k_cache, v_cache, block_tables, context_lens, scale, out=None, *, window=0, softcap=0.0,
                   sinks=None, max_splits=0):
            out = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
            started = time.perf_counter()
            # max_splits only where asked (batch_invariant): a baseline built from before it has no such argument
            extra = (max_splits,) if max_splits else ()
            op(out, q, k_cache, v_cache, block_tables, context_lens, scale, window, softcap, sinks, *extra)
            call_seconds.append(time.perf_counter() - started)
            return out
        return kernel

    kernels = [timed(op) for op in ops]
    cases = [tuple(int(x) for x in case.split("x")) for case in args.engine_cases]
    decode_steps = 2 * args.engine_rounds * args.engine_steps
    max_len = max(context for _, context in cases) + decode_steps + 8
    rng = random.Random(0)
    print(f"\nInside an engine ({args.model}, dtype {args.dtype}, quantization {args.quantization or 'none'}): median "
          f"of {args.engine_rounds} alternating rounds of {args.engine_steps} decode steps\n")
    print("| case | baseline µs a call | this kernel µs a call | speed-up | baseline step ms | this kernel step ms |")
    print("|---|---:|---:|---:|---:|---:|")
    # eager: the kernels are swapped in Python between rounds, which a replayed decode step would not see
    with LLM(args.model, dtype=args.dtype, quantization=args.quantization, max_model_len=max_len,
             max_num_seqs=max(batch for batch, _ in cases), attention_backend="cpu", enforce_eager=True) as llm:
        vocab = llm.vocab_size
        for batch, context in cases:
            params = SamplingParams(temperature=0.0, max_tokens=decode_steps + 4, ignore_eos=True)
            for _ in range(batch):
                llm.add_request([rng.randrange(vocab) for _ in range(context)], params, stream=False)
            while llm.scheduler.waiting:  # the prefills
                llm.step()
            calls, steps = [[], []], [[], []]
            for round_ in range(args.engine_rounds):
                for i in ((0, 1) if round_ % 2 else (1, 0)):
                    cpu_backend.paged_decode_attention = kernels[i]
                    call_seconds.clear()
                    for _ in range(args.engine_steps):
                        started = time.perf_counter()
                        llm.step()
                        steps[i].append(time.perf_counter() - started)
                    calls[i] += call_seconds
            while llm.has_unfinished_requests():
                llm.step()
            base, ours = statistics.median(calls[0]) * 1e6, statistics.median(calls[1]) * 1e6
            print(f"| batch {batch}, context {context} | {base:.1f} | {ours:.1f} | {base / ours:.2f}x | "
                  f"{statistics.median(steps[0]) * 1e3:.2f} | {statistics.median(steps[1]) * 1e3:.2f} |", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="HEAD~1", help="the git revision whose kernel is the baseline")
    parser.add_argument("--baseline-source", help="a file with the baseline kernel's source instead")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--cases", nargs="+", default=["1x208", "1x2048", "16x512"], help="BATCHxCONTEXT")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--model", help="a checkpoint folder: also run both kernels inside its engine")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", choices=("int8", "int4"), help="the engine's online quantization")
    parser.add_argument("--engine-cases", nargs="+", default=["1x208", "1x2048", "16x512"], help="BATCHxCONTEXT")
    parser.add_argument("--engine-rounds", type=int, default=6)
    parser.add_argument("--engine-steps", type=int, default=8)
    args = parse_with_quick(parser, argv, dict(cases=["1x40", "3x40"], rounds=3, calls=2, heads=4, kv_heads=2,
                                               head_dim=64, engine_cases=["1x40", "3x40"], engine_rounds=2,
                                               engine_steps=2, dtype="float32"))
    load()
    with tempfile.TemporaryDirectory(prefix="bench_decode_attention_") as folder:
        load_baseline = start_baseline(SOURCE, args.baseline, args.baseline_source, folder)
        if args.quick and not args.model:  # the engine part too, on a tiny model, written while the baseline builds
            from tpengine.tiny_model import write_tiny_model
            args.model = write_tiny_model(os.path.join(folder, "tiny"))
        load_baseline()
        ops = (torch.ops.tpengine_baseline.paged_decode_attention, torch.ops.tpengine_cpu.paged_decode_attention)
        print(f"paged decode attention, {args.heads} query heads, {args.kv_heads} KV heads of {args.head_dim}, "
              f"256-token blocks, {torch.get_num_threads()} threads; median of {args.rounds} alternating rounds "
              f"of {args.calls} calls\n")
        print(f"| case | dtype | baseline ({args.baseline_source or args.baseline}) µs | this kernel µs | speed-up "
              "| largest difference |")
        print("|---|---|---:|---:|---:|---:|")
        for case in args.cases:
            batch, context = (int(x) for x in case.split("x"))
            for dtype in (torch.bfloat16, torch.float32):
                base, ours, diff = run_case(ops, dtype, batch, context, args)
                print(f"| batch {batch}, context {context} | {str(dtype).removeprefix('torch.')} | {base:.1f} | "
                      f"{ours:.1f} | {base / ours:.2f}x | {diff:.1e} |", flush=True)
        if args.model:
            engine_rounds(ops, args)


if __name__ == "__main__":
    main()
