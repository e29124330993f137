"""Exact prefix reuse vs the seed's whole-block prefix cache: one shared system prompt, many requests.

The workload of issue 12: --num-seqs requests (256) that share one --system-len-token system prompt
(1,000) followed by 50-200 tokens of their own, all queued before the first step, block size 256,
--max-tokens output tokens each (8, ignore_eos, greedy). Both sides run in this process, each on a
fresh engine (empty cache), alternating --repeat times; each side's fastest run is kept.

- exact: this engine as it is (whole blocks shared by reference, the longest cached head of the
  next block copied, sharers of what a batch computes held back one step, cache-aware admission);
- block-rounded: the same engine with exact_prefix_caching off: the seed's cache alone (whole
  blocks, never the last one, in arrival order), what the engine did before.

Prompt tokens computed = prompt tokens looked up minus prefix-cache hits (the engine's counters).
Wall time is llm.generate alone (loading and a warm-up excluded). The greedy tokens of both sides
are compared: they must be equal.

    .venv/bin/python scripts/bench_prefix_cache.py [--repeat 2] [--num-seqs 256] [--device cpu]
    .venv/bin/python scripts/bench_prefix_cache.py --quick   # seconds: 4 requests sharing 300 tokens
"""
import argparse
import random
import tempfile
import time

import torch

from bench import git_revision, load_average, machine_line
from quick import parse_with_quick
from tpengine import LLM, SamplingParams
from tpengine.tiny_model import write_tiny_model

# Small enough that 100k prompt tokens take seconds on 2 CPU cores, big enough that compute shows.
MODEL = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, tie_word_embeddings=True,
             initializer_range=0.02)
BLOCK_SIZE = 256


def workload(args) -> list[list[int]]:
    rng = random.Random(args.seed)
    system = [rng.randrange(MODEL["vocab_size"]) for _ in range(args.system_len)]
    return [system + [rng.randrange(MODEL["vocab_size"]) for _ in range(rng.randint(50, 200))]
            for _ in range(args.num_seqs)]


def run(args, model: str, prompts, exact: bool):
    """(seconds, prompt tokens computed, prompt tokens hit, token ids) of one generate on a fresh engine."""
    max_len = max(map(len, prompts)) + args.max_tokens
    llm = LLM(model, device=args.device, kvcache_block_size=BLOCK_SIZE, max_model_len=max_len,
              max_num_seqs=args.num_seqs, num_kvcache_blocks=args.num_kvcache_blocks)
    try:
        # off: the seed's whole-block cache and arrival order (the scheduler reads this flag too)
        llm.scheduler.block_manager.exact_prefix_caching = exact
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        llm.generate([[1, 2, 3]], params, use_tqdm=False)  # warm-up, a prompt the workload never shares
        queries, hits = llm.prefix_cache_queries, llm.prefix_cache_hits
        if args.device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        if args.device == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - started
        queries, hits = llm.prefix_cache_queries - queries, llm.prefix_cache_hits - hits
    finally:
        llm.shutdown()
    return elapsed, queries - hits, hits, [o.token_ids for o in outputs]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--system-len", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--num-kvcache-blocks", type=int, default=700)  # 256 x (3 shared + 2 own) fit
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parse_with_quick(parser, argv, dict(num_seqs=4, system_len=300, max_tokens=2, repeat=1,
                                               num_kvcache_blocks=16))

    prompts = workload(args)
    total = sum(map(len, prompts))
    print(f"{args.num_seqs} requests: a {args.system_len}-token system prompt + 50-200 tokens each "
          f"({total:,} prompt tokens), {args.max_tokens} output tokens each, block size {BLOCK_SIZE}")
    print(f"machine: {machine_line(args.device, torch.get_num_threads())}")
    print(f"revision {git_revision()}; load average before: {load_average()}\n")
    best = {}
    with tempfile.TemporaryDirectory() as folder:
        model = write_tiny_model(folder, seed=0, with_tokenizer=False, **MODEL)
        for _ in range(args.repeat):
            for exact in (False, True):
                result = run(args, model, prompts, exact)
                if exact not in best or result[0] < best[exact][0]:
                    best[exact] = result
    assert best[True][3] == best[False][3], "exact reuse changed the greedy tokens"
    print("| prefix cache | prompt tokens computed | hit rate | wall s |")
    print("|---|---:|---:|---:|")
    for exact, name in ((False, "block-rounded (seed)"), (True, "exact (this engine)")):
        seconds, computed, hits, _ = best[exact]
        print(f"| {name} | {computed:,} | {hits / total:.1%} | {seconds:.2f} |")
    print(f"\ncomputed {best[False][1] / best[True][1]:.2f}x fewer prompt tokens, "
          f"{best[False][0] / best[True][0]:.2f}x faster; load average after: {load_average()}")


if __name__ == "__main__":
    main()
