"""Exact prefix reuse vs the seed's whole-block prefix cache, and vs no cache: one shared system prompt,
many requests.

The workload of issue 12: --num-seqs requests (256) that share one --system-len-token system prompt
(1,000) followed by 50-200 tokens of their own, all queued before the first step, block size 256,
--max-tokens output tokens each (8, ignore_eos, greedy).

- exact: this engine as it is (whole blocks shared by reference, the longest cached head of the
  next block copied, sharers of what a batch computes held back one step, cache-aware admission);
- block-rounded: the seed's cache (whole blocks, never the last one, in arrival order), its ledger
  replayed without a model (benchmarks/nano_baseline.py's scheduler, fake tokens, --max-num-batched-tokens
  per step): prompt tokens computed only, no wall time;
- none: this engine with enable_prefix_caching=False, every prompt token computed.

The two engines run in this process, each on a fresh engine (empty cache), alternating --repeat times;
each side's fastest run is kept. Prompt tokens computed = prompt tokens looked up minus prefix-cache
hits (the engine's counters). Wall time is llm.generate alone (loading and a warm-up excluded). The
greedy tokens of both engines are compared: they must be equal.

    .venv/bin/python benchmarks/bench_prefix_cache.py [--repeat 2] [--num-seqs 256] [--device cpu]
    .venv/bin/python benchmarks/bench_prefix_cache.py --quick   # seconds: 4 requests sharing 300 tokens
"""
import argparse
import random
import tempfile
import time

import torch

from tpengine.bench.results import git_revision, load_average, machine_line
from nano_baseline import NanoScheduler, NanoSequence
from tpengine.bench.quick import parse_with_quick
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


def seed_tokens_computed(args, prompts) -> int:
    """Prompt tokens the seed's whole-block cache computes for the workload: its ledger replayed."""
    NanoSequence.block_size = BLOCK_SIZE
    scheduler = NanoScheduler(args.num_kvcache_blocks, BLOCK_SIZE, args.num_seqs, args.max_num_batched_tokens, eos=-1)
    for prompt in prompts:
        scheduler.add(NanoSequence(prompt, max_tokens=args.max_tokens, ignore_eos=True))
    computed = 0
    while scheduler.waiting or scheduler.running:
        seqs, is_prefill = scheduler.schedule()
        if is_prefill:
            computed += sum(seq.num_scheduled_tokens for seq in seqs)
        scheduler.postprocess(seqs, [1] * len(seqs), is_prefill)
    return computed


def run(args, model: str, prompts, cached: bool):
    """(seconds, prompt tokens computed, prompt tokens hit, token ids) of one generate on a fresh engine."""
    max_len = max(map(len, prompts)) + args.max_tokens
    llm = LLM(model, device=args.device, kvcache_block_size=BLOCK_SIZE, max_model_len=max_len,
              max_num_seqs=args.num_seqs, num_kvcache_blocks=args.num_kvcache_blocks,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=cached)
    try:
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
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)  # the CPU's default
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
            for cached in (False, True):
                result = run(args, model, prompts, cached)
                if cached not in best or result[0] < best[cached][0]:
                    best[cached] = result
    assert best[True][3] == best[False][3], "the prefix cache changed the greedy tokens"
    seed_computed = seed_tokens_computed(args, prompts)
    print("| prefix cache | prompt tokens computed | hit rate | wall s |")
    print("|---|---:|---:|---:|")
    print(f"| none (enable_prefix_caching=False) | {best[False][1]:,} | {best[False][2] / total:.1%} "
          f"| {best[False][0]:.2f} |")
    print(f"| block-rounded (the seed's, ledger replayed) | {seed_computed:,} | {1 - seed_computed / total:.1%} | - |")
    seconds, computed, hits, _ = best[True]
    print(f"| exact (this engine) | {computed:,} | {hits / total:.1%} | {seconds:.2f} |")
    print(f"\nexact reuse computed {seed_computed / computed:.2f}x fewer prompt tokens than the seed's cache and "
          f"{best[False][1] / computed:.2f}x fewer than none, {best[False][0] / seconds:.2f}x faster than none; "
          f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
