"""Structured outputs' cost on rank 0: per constrained sequence per decode step, and a new schema's first token.

A decode step's sampling of --sizes rows (64 and 256) over a vocabulary, unconstrained and with every row
following a JSON schema (its matcher filling the row's token mask, the mask applied to the logits, the
sampled token taken by the matcher): rank 0's added cost per constrained sequence per step is the
difference over the rows. The vocabularies: the tiny model's byte tokenizer (320 rows) and a synthetic
151,936-token one (Qwen3's size, shaped as a BPE vocabulary: word pieces, numbers, some punctuation; no
real one can be downloaded here). The matchers are first
walked a few tokens into their grammars, as a decoding request's are. Also, through the engine on the tiny
model, the time to the first token of a request whose schema is new against one whose schema is cached.

Reported per case: median µs per step over --steps steps after --warmup, alternating unconstrained and
constrained steps. The aim: at most 50 µs per constrained sequence per step, and none for the others.

Then, with --tp 2 (default; 0 skips it), whole engine steps of --tp-rows decode rows of a random model with
the 151,936-token vocabulary (hidden 64, 2 layers: the LM head and the sampling are most of a step), none, one
or every row constrained by a regex: each rank samples its own slice of the vocabulary and reads the
constrained rows' token masks from the step message, so a constrained row should cost its neighbours nothing.

    .venv/bin/python benchmarks/bench_structured.py [--sizes 64 256] [--steps 30]
    .venv/bin/python benchmarks/bench_structured.py --quick     # seconds: 8 rows, a few steps
"""
import argparse
import json
import random
import statistics
import tempfile
import time

import torch
import xgrammar as xgr

from tpengine.bench.quick import parse_with_quick
from tpengine.runner.sampler import Sampler
from tpengine.sampling_params import SamplingParams, SamplingRecord, StructuredOutputsParams
from tpengine.structured.compiler import GrammarCompiler
from tpengine.structured.matcher import SequenceGrammar

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "tags", "address"]}


def synthetic_tokenizer_info(vocab_size: int, seed: int = 0) -> xgr.TokenizerInfo:
    """A byte-level vocabulary of vocab_size distinct tokens shaped as a BPE vocabulary's are: the 256 bytes,
    then word pieces (letters, often after a space), numbers, and a few runs of punctuation."""
    rng = random.Random(seed)
    tokens, seen = [bytes([b]) for b in range(256)], set()
    letters, digits, punctuation = b"abcdefghijklmnopqrstuvwxyz", b"0123456789", b" ,.:;\"{}[]()-_!?'"
    while len(tokens) < vocab_size - 1:
        kind = rng.random()
        if kind < 0.9:  # a word piece, half of them starting a word
            piece = bytes(rng.choice(letters) for _ in range(rng.randint(2, 9)))
            token = (b" " + piece if rng.random() < 0.5 else piece)
            token = token.capitalize() if rng.random() < 0.1 else token
        elif kind < 0.97:
            token = bytes(rng.choice(digits) for _ in range(rng.randint(1, 3)))
        else:
            token = bytes(rng.choice(punctuation) for _ in range(rng.randint(2, 4)))
        if token not in seen:
            seen.add(token)
            tokens.append(token)
    tokens.append(b"<|endoftext|>")
    return xgr.TokenizerInfo(tokens, vocab_type=xgr.VocabType.RAW, vocab_size=vocab_size,
                             stop_token_ids=[vocab_size - 1])


def tiny_tokenizer_info() -> xgr.TokenizerInfo:
    from transformers import AutoTokenizer

    from tpengine.tiny_model import write_tiny_model
    with tempfile.TemporaryDirectory() as folder:
        path = write_tiny_model(folder, seed=0)
        with open(f"{path}/config.json") as f:
            vocab_size = json.load(f)["vocab_size"]
        tokenizer = AutoTokenizer.from_pretrained(path)
        return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=[tokenizer.eos_token_id])


def records(n: int, compiled, walk: int, vocab_size: int, rng: torch.Generator) -> list[SamplingRecord]:
    """n sampled rows; with compiled, each row's matcher first walked `walk` tokens into its grammar."""
    params = SamplingParams(temperature=1.0, max_tokens=1024)
    rows = [SamplingRecord(params, frozenset(), [1, 2, 3], 3) for _ in range(n)]
    if compiled is not None:
        bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        for record in rows:
            record.grammar = SequenceGrammar(compiled)
            for _ in range(walk):
                logits = torch.randn(1, vocab_size, generator=rng)
                record.grammar.matcher.fill_next_token_bitmask(bitmask)
                xgr.apply_token_bitmask_inplace(logits, bitmask)
                token = int(logits.argmax())
                if token == vocab_size - 1 or not record.grammar.accept(token):
                    break
    return rows


def step_us(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRecord], work: torch.Tensor) -> float:
    """One decode step's rank-0 sampling work: sample every row, then each matcher takes its token. The logits
    are copied into `work` first (the mask writes them), a buffer reused step after step as the LM head's output
    is: a fresh clone of 64 x 151,936 floats page-faults for ~15 ms, noise larger than what is measured."""
    work.copy_(logits)
    started = time.perf_counter()
    tokens = sampler(work, rows).token_ids
    for record, token in zip(rows, tokens):
        if record.grammar is not None:
            record.grammar.accept(token)
            record.grammar.matcher.rollback(1)  # the next step starts from the same place
    return (time.perf_counter() - started) * 1e6


def bench_vocabulary(name: str, info: xgr.TokenizerInfo, args) -> list[str]:
    compiler = GrammarCompiler(info)
    spec = StructuredOutputsParams(json=SCHEMA)
    compiled = compiler.compile(spec).result()
    vocab_size = info.vocab_size
    rng = torch.Generator().manual_seed(0)
    sampler = Sampler(seed=0)
    lines = []
    for n in args.sizes:
        free, constrained = records(n, None, 0, vocab_size, rng), records(n, compiled, args.walk, vocab_size, rng)
        logits = torch.randn(n, vocab_size, generator=rng)
        work = torch.empty_like(logits)
        times = {"free": [], "constrained": []}
        for i in range(args.warmup + args.steps):
            for kind, rows in (("free", free), ("constrained", constrained)):
                us = step_us(sampler, logits, rows, work)
                if i >= args.warmup:
                    times[kind].append(us)
        free_us, constrained_us = statistics.median(times["free"]), statistics.median(times["constrained"])
        lines.append(f"| {name} | {vocab_size:,} | {n} | {free_us:,.0f} | {constrained_us:,.0f} | "
                     f"{(constrained_us - free_us) / n:.1f} |")
    compiler.close()
    return lines


def first_token_ms(args) -> tuple[float, float]:
    """ms to the first token of a request whose schema is new, and of one whose schema is cached (tiny model)."""
    from tpengine import LLM
    from tpengine.tiny_model import write_tiny_model
    with tempfile.TemporaryDirectory() as folder:
        llm = LLM(write_tiny_model(folder, seed=0), kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256)
        try:
            llm.generate(["warm up"], SamplingParams(max_tokens=1), use_tqdm=False)

            def first_token(schema) -> float:
                params = SamplingParams(max_tokens=1, structured_outputs=StructuredOutputsParams(json=schema))
                started = time.perf_counter()
                llm.generate(["first"], params, use_tqdm=False)
                return (time.perf_counter() - started) * 1e3
            new = [first_token({**SCHEMA, "title": f"new {i}"}) for i in range(args.ttft_repeats)]
            cached = [first_token({**SCHEMA, "title": "new 0"}) for _ in range(args.ttft_repeats)]
        finally:
            llm.shutdown()
    return statistics.median(new), statistics.median(cached)


def engine_steps(args) -> list[tuple[int, float, float]]:
    """Median ms of an engine's decode steps with none, one and every row constrained (a regex most byte tokens
    meet), alternating over two rounds, the best kept; each with its ratio to none."""
    from tpengine import LLM
    from tpengine.tiny_model import write_tiny_model
    rows = args.tp_rows
    spec = StructuredOutputsParams(regex=r"[a-z ]{100,400}")
    counts = sorted({0, 1, rows})
    with tempfile.TemporaryDirectory() as folder:
        path = write_tiny_model(folder, seed=0, vocab_size=args.large_vocab, hidden_size=64, intermediate_size=128,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                tie_word_embeddings=False)
        llm = LLM(path, tensor_parallel_size=args.tp, max_num_seqs=rows, max_model_len=512)
        rng = random.Random(0)
        best = {}
        try:
            for _ in range(2):
                for constrained in counts:
                    for i in range(rows):
                        params = SamplingParams(temperature=1.0, seed=i, max_tokens=args.warmup + args.steps + 4,
                                                ignore_eos=True, structured_outputs=spec if i < constrained else None)
                        llm.add_request([rng.randrange(256) for _ in range(16)], params, stream=False)
                    for _ in range(1 + args.warmup):  # the prefill, then warm-up
                        llm.step()
                    times = []
                    for _ in range(args.steps):
                        started = time.perf_counter()
                        llm.step()
                        times.append((time.perf_counter() - started) * 1e3)
                    while llm.has_unfinished_requests():
                        llm.step()
                    best[constrained] = min(best.get(constrained, float("inf")), statistics.median(times))
        finally:
            llm.shutdown()
    return [(c, best[c], best[c] / best[0]) for c in counts]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--walk", type=int, default=12, help="tokens each matcher is walked into its grammar first")
    parser.add_argument("--large-vocab", type=int, default=151_936)
    parser.add_argument("--ttft-repeats", type=int, default=5)
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size of the engine steps (0: none)")
    parser.add_argument("--tp-rows", type=int, default=64, help="decode rows of each engine step")
    args = parse_with_quick(parser, argv, dict(sizes=[8], steps=3, warmup=1, walk=4, large_vocab=4096,
                                               ttft_repeats=1, tp_rows=4))
    torch.set_num_threads(min(2, torch.get_num_threads()))
    print(f"rank 0's sampling of one decode step (median of {args.steps} after {args.warmup}), a JSON schema "
          f"on every constrained row; {torch.get_num_threads()} threads\n")
    print("| vocabulary | tokens | rows | unconstrained µs/step | constrained µs/step | µs per constrained row |")
    print("|---|---:|---:|---:|---:|---:|")
    for line in bench_vocabulary("tiny byte tokenizer", tiny_tokenizer_info(), args):
        print(line, flush=True)
    for line in bench_vocabulary("synthetic byte strings", synthetic_tokenizer_info(args.large_vocab), args):
        print(line, flush=True)
    new_ms, cached_ms = first_token_ms(args)
    print(f"\ntime to the first token (tiny model, 1 token): new schema {new_ms:.1f} ms, cached schema "
          f"{cached_ms:.1f} ms")
    if args.tp:
        print(f"\nengine steps at tp {args.tp}, {args.tp_rows} decode rows, vocabulary {args.large_vocab:,} "
              f"(median ms of {args.steps} steps after {args.warmup})\n")
        print("| rows constrained | step ms | vs none |")
        print("|---:|---:|---:|")
        for constrained, ms, ratio in engine_steps(args):
            print(f"| {constrained} of {args.tp_rows} | {ms:.2f} | {ratio:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
