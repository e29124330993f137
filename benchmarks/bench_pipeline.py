"""Pipeline parallelism on the CPU (issue 30): pp 2 with steps in flight vs pp 2 with one step at a time vs tp 2
vs tp 1, end to end in one run, and the bytes a step sends between stages against a tensor-parallel step's
all-reduces.

Model (random weights, written once and cached in the tpengine-bench cache folder, or --model): a Qwen3 of vocab
4096, hidden 1024, 8 layers, 16 heads of 64 (4 KV heads), intermediate 3072, float32 (about 100M parameters: a
step's compute, not its messages, is what the stages overlap).

Each configuration gets its own engine (block size 16, the auto backend) and generates --num-prompts random
prompts of --prompt-len tokens, --output-len greedy tokens each (ignore_eos), in one llm.generate, timed from
the call to its return; throughput = (prompt + output tokens) / seconds. Every rank of every configuration shares
this host's cores (the engine gives each rank cores / ranks threads), so on 2 cores the point is not that a
pipeline is faster than one rank, but what steps in flight buy over a pipeline whose stages take turns.

Every round runs every configuration, the order rotating round by round (--repeat); each keeps its best.

    .venv/bin/python benchmarks/bench_pipeline.py            # 32 prompts of 128, 32 tokens each
    .venv/bin/python benchmarks/bench_pipeline.py --quick    # seconds
"""
import argparse
import os
import random
import time

from tpengine.bench.results import Record, add_json_flag
from tpengine import LLM, SamplingParams
from tpengine.cache import cache_dir
from tpengine.tiny_model import write_tiny_model

MODEL = dict(vocab_size=4096, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=4, head_dim=64, tie_word_embeddings=False, initializer_range=0.05)
QUICK_MODEL = dict(MODEL, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=512)
CONFIGURATIONS = {  # name -> engine settings
    "tp 1": dict(tensor_parallel_size=1),
    "tp 2": dict(tensor_parallel_size=2),
    "pp 2, one step at a time": dict(pipeline_parallel_size=2, max_steps_in_flight=1),
    "pp 2, 2 steps in flight": dict(pipeline_parallel_size=2),
}
# Two nodes on paper: a dense model of Qwen3-32B's shape in bfloat16, a step of 256 decode tokens
PAPER_MODEL = dict(name="Qwen3-32B shape (hidden 5120, 64 layers), bfloat16", hidden_size=5120, num_layers=64,
                   dtype_bytes=2, tokens=256)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--model", help="a checkpoint to run instead of the cached random one")
    parser.add_argument("--repeat", type=int, default=2, help="rounds; each figure keeps its best")
    parser.add_argument("--quick", action="store_true", help="a 2-layer model, 4 prompts of 16, 4 tokens, 1 round")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.num_prompts, args.prompt_len, args.output_len, args.repeat = 4, 16, 4, 1
    return args


def checkpoint(args) -> tuple[str, dict]:
    shape = QUICK_MODEL if args.quick else MODEL
    if args.model and os.path.isdir(args.model):
        return args.model, shape
    path = args.model or os.path.join(cache_dir("tpengine-bench"), "pipeline_qwen3_1024x8")
    if not os.path.isdir(path):
        write_tiny_model(path, seed=30, with_tokenizer=False, **shape)
    return path, shape


def run(path: str, settings: dict, prompts: list[list[int]], output_len: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    with LLM(path, kvcache_block_size=16, **settings) as llm:
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
    tokens = sum(len(p) for p in prompts) + sum(len(o.outputs[0].token_ids) for o in outputs)
    return dict(seconds=seconds, tok_s=tokens / seconds, tokens=[o.outputs[0].token_ids for o in outputs])


def step_bytes(hidden_size: int, num_layers: int, dtype_bytes: int, tokens: int, ranks: int) -> dict:
    """Bytes one step of `tokens` tokens sends: pp (2 stages) passes hidden states and residual once, and the token
    ids back; tp (ranks ranks) all-reduces the hidden states twice a layer, a ring all-reduce sending 2(n-1)/n
    of the tensor from each rank."""
    activation = tokens * hidden_size * dtype_bytes
    return dict(pp=2 * activation + 8 * tokens, tp=2 * num_layers * activation * 2 * (ranks - 1) / ranks)


def main(argv=None) -> None:
    args = parse_args(argv)
    record = Record("pipeline", argv)
    path, shape = checkpoint(args)
    rng = random.Random(0)
    prompts = [rng.choices(range(shape["vocab_size"]), k=args.prompt_len) for _ in range(args.num_prompts)]
    best = {}
    names = list(CONFIGURATIONS)
    for round_ in range(args.repeat):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            row = run(path, CONFIGURATIONS[name], prompts, args.output_len)
            if name not in best or row["tok_s"] > best[name]["tok_s"]:
                best[name] = row
    baseline = best["pp 2, one step at a time"]["tok_s"]
    print(f"{args.num_prompts} prompts of {args.prompt_len} tokens, {args.output_len} greedy tokens each, "
          f"{os.cpu_count()} cores shared by every rank")
    print("| configuration | seconds | tok/s (prompt + output) | vs pp 2 one step at a time |")
    print("|---|---|---|---|")
    for name in names:
        row = best[name]
        print(f"| {name} | {row['seconds']:.2f} | {row['tok_s']:.0f} | {row['tok_s'] / baseline:.2f}x |")
    same = all(best[name]["tokens"] == best["tp 1"]["tokens"] for name in names)
    print(f"every configuration writes the same tokens: {same}")
    # the bytes between ranks: this model's decode step of num_prompts tokens, and the paper model's
    here = step_bytes(shape["hidden_size"], shape["num_hidden_layers"], 4, args.num_prompts, 2)
    paper = step_bytes(PAPER_MODEL["hidden_size"], PAPER_MODEL["num_layers"], PAPER_MODEL["dtype_bytes"],
                       PAPER_MODEL["tokens"], 2)
    print(f"bytes a decode step of {args.num_prompts} tokens sends, this model in float32: pp 2 {here['pp']:,.0f}, "
          f"tp 2 {here['tp']:,.0f} per rank ({here['tp'] / here['pp']:.0f}x)")
    print(f"{PAPER_MODEL['name']}, {PAPER_MODEL['tokens']} decode tokens, across two nodes:")
    print("| link | pp 2: stage to stage | tp 2: all-reduces |")
    print("|---|---|---|")
    for gbit in (100, 200, 400):
        per_s = gbit * 1e9 / 8
        print(f"| {gbit} Gb/s | {paper['pp'] / 1e6:.1f} MB, {paper['pp'] / per_s * 1e3:.2f} ms | "
              f"{paper['tp'] / 1e6:.0f} MB, {paper['tp'] / per_s * 1e3:.1f} ms |")
    record.write(args.json, num_prompts=args.num_prompts, prompt_len=args.prompt_len, output_len=args.output_len,
                 rows={name: {k: v for k, v in row.items() if k != "tokens"} for name, row in best.items()},
                 same_tokens=same, step_bytes_here=here, step_bytes_paper=paper)


if __name__ == "__main__":
    main()
