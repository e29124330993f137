"""Scoring workloads on the CPU (issue 50): what prompt logprobs cost with the prefix cache and without it, and what
batch-invariant mode costs, in one run.

Model: tpengine.bench's CPU_MODEL (a random-weight Qwen3 of ~34M parameters, written once into the bench cache), or
--model; --quick: QUICK_MODEL. Every figure is a median over --repeat rounds, the configurations' order rotating
round by round, and each ratio the median of the same round's ratios.

Prompt logprobs: lm-eval-harness's multiple-choice shape, --questions contexts of --context-len random tokens,
each followed by --choices continuations of --continuation-len tokens; every prompt is one prompt-only request
(max_tokens=0, prompt_logprobs=1: the actual token's logprob and the top one, as lm-eval's loglikelihood asks),
all submitted at once. Fresh token ids every round, so no round hits an earlier one's cache. Configurations:

- plain prefill: the same prompts, max_tokens=1, no logprobs (what computing the prompts costs at all);
- prompt logprobs, cache on: the prefix cache keeps each block's prompt logprobs (the context is computed once);
- prompt logprobs, cache off: enable_prefix_caching=False (what vLLM does for prompt-logprob requests).

Batch invariance: engines with batch_invariant off and on (prefix caching off): the median llm.step() decode time at
each --batch-sizes batch of --decode-context-len-token prompts (greedy), and the time to prefill one
--prefill-len-token prompt (max_tokens=1) in chunks of --max-num-batched-tokens.

    .venv/bin/python benchmarks/bench_scoring.py            # a few minutes on 2 cores
    .venv/bin/python benchmarks/bench_scoring.py --quick    # seconds
"""
import argparse
import os
import random
import statistics
import sys
import time

from tpengine.bench.models import CACHE, CPU_MODEL, QUICK_MODEL, write_model
from tpengine.bench.quick import parse_with_quick
from tpengine.bench.results import Record, add_json_flag, load_average, machine_line
from tpengine.bench.timing import decode_step_ms

PLAIN, CACHED, UNCACHED = "plain prefill", "prompt logprobs, cache on", "prompt logprobs, cache off"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="existing checkpoint folder (default: the random CPU_MODEL Qwen3)")
    p.add_argument("--questions", type=int, default=8, help="contexts, each with --choices continuations")
    p.add_argument("--choices", type=int, default=4)
    p.add_argument("--context-len", type=int, default=256)
    p.add_argument("--continuation-len", type=int, default=16)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16], help="decode batches timed")
    p.add_argument("--decode-context-len", type=int, default=256)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--block-size", type=int, help="KV-cache block size (default: the engine's)")
    p.add_argument("--steps", type=int, default=20, help="decode steps timed per batch")
    p.add_argument("--warm-up-steps", type=int, default=3)
    p.add_argument("--repeat", type=int, default=3, help="rounds, the configurations' order rotating")
    add_json_flag(p)
    args = parse_with_quick(p, argv, dict(questions=2, choices=2, context_len=32, continuation_len=4,
                                          batch_sizes=[1, 4], decode_context_len=16, prefill_len=64,
                                          max_num_batched_tokens=32, block_size=16, steps=3, warm_up_steps=1, repeat=1),
                            "QUICK_MODEL")
    if min(args.questions, args.choices, args.context_len, args.continuation_len, args.steps, args.repeat,
           args.prefill_len, args.decode_context_len, *args.batch_sizes) < 1:
        p.error("sizes and counts must be >= 1")
    return args


def engine(model: str, args, **settings):
    from tpengine import LLM
    return LLM(model, dtype="float32", device="cpu", max_model_len=max(args.prefill_len, args.decode_context_len,
                                                                        args.context_len + args.continuation_len) + 64,
               max_num_seqs=max(max(args.batch_sizes), args.questions * args.choices),
               max_num_batched_tokens=args.max_num_batched_tokens,
               **({} if args.block_size is None else {"kvcache_block_size": args.block_size}), **settings)


def questions(rng: random.Random, args, vocab: int) -> list[list[int]]:
    prompts = []
    for _ in range(args.questions):
        context = [rng.randrange(vocab) for _ in range(args.context_len)]
        prompts += [context + [rng.randrange(vocab) for _ in range(args.continuation_len)]
                    for _ in range(args.choices)]
    return prompts


def time_scoring(llm, prompts: list[list[int]], logprobs: bool) -> tuple[float, int]:
    """(seconds, prompt tokens computed) of one batch of prompt-only (or one-token) requests."""
    from tpengine import SamplingParams
    params = SamplingParams(max_tokens=0, prompt_logprobs=1) if logprobs else SamplingParams(max_tokens=1)
    computed = llm.prompt_tokens_total
    started = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - started, llm.prompt_tokens_total - computed


def prompt_logprob_rounds(model: str, args) -> dict[str, dict[str, list[float]]]:
    cached, uncached = engine(model, args), engine(model, args, enable_prefix_caching=False)
    engines = {PLAIN: (cached, False), CACHED: (cached, True), UNCACHED: (uncached, True)}
    rng = random.Random(0)
    figures = {name: {"seconds": [], "tokens": []} for name in engines}
    try:
        for round_ in range(args.repeat):
            order = list(engines)[round_ % 3:] + list(engines)[:round_ % 3]
            for name in order:
                llm, logprobs = engines[name]
                seconds, tokens = time_scoring(llm, questions(rng, args, llm.vocab_size), logprobs)
                figures[name]["seconds"].append(seconds)
                figures[name]["tokens"].append(tokens)
    finally:
        cached.shutdown()
        uncached.shutdown()
    return figures


def invariance_rounds(model: str, args) -> dict[str, dict[str, list[float]]]:
    from tpengine import SamplingParams
    engines = {"off": engine(model, args, enable_prefix_caching=False),
               "on": engine(model, args, enable_prefix_caching=False, batch_invariant=True)}
    rng = random.Random(1)
    figures = {name: {f"decode_ms_{b}": [] for b in args.batch_sizes} | {"prefill_s": []} for name in engines}
    try:
        for round_ in range(args.repeat):
            for name in (list(engines) if round_ % 2 == 0 else list(engines)[::-1]):
                llm = engines[name]
                for batch in args.batch_sizes:
                    figures[name][f"decode_ms_{batch}"].append(
                        decode_step_ms(llm, rng, batch, args.decode_context_len, args.steps, args.warm_up_steps))
                prompt = [rng.randrange(llm.vocab_size) for _ in range(args.prefill_len)]
                started = time.perf_counter()
                llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
                figures[name]["prefill_s"].append(time.perf_counter() - started)
    finally:
        for llm in engines.values():
            llm.shutdown()
    return figures


def ratio(numerators: list[float], denominators: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(numerators, denominators))


def report(args, logprobs: dict, invariance: dict) -> None:
    print(f"\nprompt logprobs: {args.questions} contexts of {args.context_len} tokens x {args.choices} continuations "
          f"of {args.continuation_len}, one batch; median of {args.repeat} rounds\n")
    print("| configuration | seconds | prompt tokens computed | vs plain prefill |")
    print("|---|---|---|---|")
    for name, figures in logprobs.items():
        print(f"| {name} | {statistics.median(figures['seconds']):.3f} | {statistics.median(figures['tokens']):.0f} | "
              f"{ratio(figures['seconds'], logprobs[PLAIN]['seconds']):.2f}x |")
    print(f"\nbatch invariance: decode steps over {args.decode_context_len}-token prompts, a {args.prefill_len}-token "
          f"prefill in chunks of {args.max_num_batched_tokens}; median of {args.repeat} rounds\n")
    print("| measure | batch_invariant off | on | on / off |")
    print("|---|---|---|---|")
    for key in [f"decode_ms_{b}" for b in args.batch_sizes] + ["prefill_s"]:
        label = f"decode step, batch {key.rsplit('_', 1)[1]} (ms)" if key.startswith("decode") else "prefill (s)"
        off, on = invariance["off"][key], invariance["on"][key]
        print(f"| {label} | {statistics.median(off):.3f} | {statistics.median(on):.3f} | {ratio(on, off):.2f}x |")


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch
    record = Record("bench_scoring", argv, machine_line("cpu", torch.get_num_threads()))
    model = args.model or write_model("cpu", os.path.join(CACHE, "quick_model" if args.quick else "cpu_model"),
                                      QUICK_MODEL if args.quick else CPU_MODEL)
    print(f"{machine_line('cpu', torch.get_num_threads())}; load {load_average()}", file=sys.stderr)
    logprobs = prompt_logprob_rounds(model, args)
    invariance = invariance_rounds(model, args)
    report(args, logprobs, invariance)
    record.write(args.json, prompt_logprobs=logprobs, batch_invariance=invariance)


if __name__ == "__main__":
    main()
