"""Decode speed on the CPU by dtype: float32 against bfloat16 and float16 weights, in one run.

One engine per dtype, all in this process. For each batch size, rounds alternate between the dtypes:
each round adds `batch` requests (random prompts of --context-len tokens, ignore_eos), runs their
prefill, then times --steps decode steps with llm.step(); a dtype's figure is its best round's median
step. Alternating rounds keep a shared machine's load from favouring one dtype. Prints what each engine
actually runs in: a half dtype this CPU cannot compute fast runs as float32 (one log line says why).

    python benchmarks/bench_cpu_dtype.py                                   # the random Qwen3 below, batches 1 4 16
    python benchmarks/bench_cpu_dtype.py --model PATH --batch-sizes 1 --rounds 5
    python benchmarks/bench_cpu_dtype.py --dtypes float32 --batch-sizes 1 16 --float16-forms
    python benchmarks/bench_cpu_dtype.py --batch-sizes 1 --agreement 32   # bfloat16 greedy tokens vs transformers'
    python benchmarks/bench_cpu_dtype.py --quick                          # seconds: tpengine.bench's QUICK_MODEL, batches 1 2
"""
import argparse
import logging
import os
import random
import statistics
import sys
import tempfile
import time

import torch

from tpengine.bench.results import load_average
from tpengine.bench.models import QUICK_MODEL
from tpengine.bench.quick import parse_with_quick

# llama.cpp's anchor model in docs/archive/benchmark-history.md: a random Qwen3 with an untied 8192-token head
ANCHOR_MODEL = dict(vocab_size=8192, hidden_size=512, intermediate_size=1024, num_hidden_layers=6,
                    num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
                    tie_word_embeddings=False, initializer_range=0.02)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint folder (default: a random Qwen3 of the llama.cpp anchor's shape)")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float16"],
                   choices=("float32", "bfloat16", "float16"))
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4, 16])
    p.add_argument("--context-len", type=int, default=208, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=24, help="decode steps timed per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds per dtype and batch size, alternating")
    p.add_argument("--agreement", type=int, default=0, metavar="N",
                   help="also compare bfloat16's greedy tokens with transformers' (bfloat16 and float32) on N prompts")
    p.add_argument("--agreement-tokens", type=int, default=32, help="greedy tokens per prompt for --agreement")
    p.add_argument("--float16-forms", action="store_true",
                   help="also time the forms a float16 linear could take on this CPU (what the fallback chose)")
    args = parse_with_quick(p, argv, dict(batch_sizes=[1, 2], context_len=8, steps=2, rounds=1, agreement_tokens=4),
                            "tpengine.bench's QUICK_MODEL")
    if min(*args.batch_sizes, args.context_len, args.steps, args.rounds) < 1:
        p.error("sizes and counts must be >= 1")
    return args


def decode_round(llm, batch: int, context_len: int, steps: int, rng: random.Random) -> float:
    """Median ms of one decode step (a step with no prompt tokens in it) of `batch` sequences."""
    from tpengine import SamplingParams

    vocab = llm.executor.runner.hf_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    for _ in range(batch):
        llm.add_request([rng.randrange(vocab) for _ in range(context_len)], params, stream=False)
    executor, prefills = llm.executor, []
    submit = executor.submit  # one stage: a step runs whole in submit
    executor.submit = lambda plan: prefills.append(bool(plan.message.prefill)) or submit(plan)
    times = []
    try:
        while llm.has_unfinished_requests():
            started = time.perf_counter()
            llm.step()
            if not prefills[-1]:
                times.append((time.perf_counter() - started) * 1e3)
    finally:
        del executor.submit  # the instance attribute goes, the class's method is back
    return statistics.median(times)


def run(args, model: str) -> list[str]:
    from tpengine import LLM

    max_len = args.context_len + args.steps + 4
    engines = {d: LLM(model, device="cpu", dtype=d, max_num_seqs=max(args.batch_sizes), max_model_len=max_len,
                      kvcache_memory_gb=0.25) for d in args.dtypes}
    try:
        runs_in = {d: str(llm.executor.runner.dtype).removeprefix("torch.") for d, llm in engines.items()}
        rng = random.Random(0)
        best = {}
        for batch in args.batch_sizes:
            for d, llm in engines.items():  # warm-up: a round's shapes once per engine
                decode_round(llm, batch, args.context_len, 4, rng)
            for _ in range(args.rounds):
                for d, llm in engines.items():
                    ms = decode_round(llm, batch, args.context_len, args.steps, rng)
                    best[d, batch] = min(best.get((d, batch), ms), ms)
    finally:
        for llm in engines.values():
            llm.shutdown()
    base = args.dtypes[0]
    lines = ["| batch | " + " | ".join(f"{d} (runs in {runs_in[d]}): tok/s, ms/step, vs {base}" for d in args.dtypes)
             + " |", "|---:|" + "---:|" * len(args.dtypes)]
    for b in args.batch_sizes:
        cells = [f"{b / best[d, b] * 1e3:,.0f}, {best[d, b]:.2f}, {best[base, b] / best[d, b]:.2f}x"
                 for d in args.dtypes]
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    return lines


def float16_forms(batch_sizes: list[int], out_features: int = 2048, in_features: int = 512,
                  repeats: int = 200) -> list[str]:
    """us per call of one [out, in] linear in the forms a float16 model could run in on this CPU."""
    import torch.nn.functional as F

    from tpengine.platforms.cpu import linear, pack_linear_weight

    weight = torch.randn(out_features, in_features)
    half = weight.half()
    packed = pack_linear_weight(weight)
    lines = [f"float16 linear forms, [{out_features}, {in_features}] weight, us per call (best of 5):", "",
             "| rows | float32 weights converted at load (the fallback) | float16 weights, torch's float16 matmul "
             "| float16 weights upcast per call |", "|---:|---:|---:|---:|"]
    for rows in batch_sizes:
        x = torch.randn(rows, in_features)
        forms = [lambda: linear(x, weight, None, packed), lambda: F.linear(x.half(), half),
                 lambda: F.linear(x, half.float())]
        cells = []
        for form in forms:
            form()
            best = float("inf")
            for _ in range(5):
                started = time.perf_counter()
                for _ in range(repeats):
                    form()
                best = min(best, (time.perf_counter() - started) / repeats * 1e6)
            cells.append(f"{best:,.1f}")
        lines.append(f"| {rows} | " + " | ".join(cells) + " |")
    return lines


def agreement(model: str, num_prompts: int, max_tokens: int, context_len: int) -> list[str]:
    """How far tpengine's bfloat16 greedy tokens follow transformers' in bfloat16 (and in float32, the oracle)."""
    from transformers import AutoModelForCausalLM

    from tpengine import LLM, SamplingParams

    rng = random.Random(1)
    with LLM(model, device="cpu", dtype="bfloat16", max_model_len=context_len + max_tokens + 1,
             kvcache_memory_gb=0.25) as llm:
        vocab = llm.executor.runner.hf_config.vocab_size
        prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, context_len))] for _ in range(num_prompts)]
        ours = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                          ignore_eos=True), use_tqdm=False)]

    def greedy(dtype):
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).eval()
        with torch.inference_mode():
            return [hf.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
                                eos_token_id=None, attention_mask=torch.ones(1, len(p), dtype=torch.long))
                    [0, len(p):].tolist() for p in prompts]

    def summary(a, b) -> str:
        parts = [next((i for i, (x, y) in enumerate(zip(x_, y_)) if x != y), None) for x_, y_ in zip(a, b)]
        split = sorted(d for d in parts if d is not None)
        return (f"{parts.count(None)}/{len(parts)} prompts match all {max_tokens} tokens; first divergence at "
                + (", ".join(map(str, split)) if split else "-"))

    hf_bf16, hf_f32 = greedy(torch.bfloat16), greedy(torch.float32)
    return [f"greedy agreement, {num_prompts} random prompts of 1-{context_len} tokens, {max_tokens} tokens each:",
            "", "| compared | agreement |", "|---|---|",
            f"| tpengine bfloat16 vs transformers bfloat16 | {summary(ours, hf_bf16)} |",
            f"| tpengine bfloat16 vs transformers float32 | {summary(ours, hf_f32)} |",
            f"| transformers bfloat16 vs transformers float32 | {summary(hf_bf16, hf_f32)} |"]


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(f"load average before: {load_average()}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    with tempfile.TemporaryDirectory(prefix="tpengine-dtype-") as tmp:
        model = args.model
        if model is None:
            from tpengine.tiny_model import write_tiny_model
            model = write_tiny_model(os.path.join(tmp, "model"), seed=0, with_tokenizer=False,
                                     **(QUICK_MODEL if args.quick else ANCHOR_MODEL))
        lines = run(args, model)
        if args.agreement:
            lines += ["", *agreement(model, args.agreement, args.agreement_tokens, args.context_len)]
    print(f"context {args.context_len}, best of {args.rounds} rounds of {args.steps} decode steps (median step)")
    print("\n".join(lines))
    if args.float16_forms:
        print("\n".join(["", *float16_forms(args.batch_sizes)]))
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    sys.exit(main())
