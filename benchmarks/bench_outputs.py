"""Rank-0 cost of request outputs in a decode step: streaming and stop strings on vs off.

A real LLMEngine (tiny model, real scheduler, detokenizer and outputs) whose executor is replaced by
a replay of fixed token ids, so a step measures exactly what rank 0 does between two forward passes:
schedule(), postprocess(), incremental detokenization, stop-string matching and building the
RequestOutputs. Tokens come from a byte-level BPE tokenizer (4,096 tokens) trained here on English
text, replayed from that text, so texts, merges and partial stop-string matches look like real ones.
Streamed requests get cumulative outputs (everything so far each step) or delta outputs (only what is new, vLLM's
RequestOutputKind.DELTA, what `tpengine serve` streams). Each case runs llm.step() (outputs built in the step, as a
loop over step() pays them); the server's case runs llm.step_reports() instead, as `tpengine serve`'s engine thread
does, and times building its outputs apart (the server's event loop does that while the next step runs). Baseline:
the same step with neither streaming nor stop strings (what generate() pays), same run.

    .venv/bin/python benchmarks/bench_outputs.py [--seqs 256] [--steps 200] [--warmup 50] [--rounds 2]
    .venv/bin/python benchmarks/bench_outputs.py --quick    # seconds: 6 sequences, 4 steps, 1 round
"""
import argparse
import gc
import glob
import os
import random
import statistics
import tempfile
import time

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tpengine.bench.quick import parse_with_quick
from tpengine import LLM, SamplingParams
from tpengine.sampling_params import RequestOutputKind
from tpengine.runner.sampler import SamplerOutput
from tpengine.tiny_model import write_tiny_model

VOCAB = 4096
BLOCK_SIZE = 256
STOPS = ["\n\nUser:", "###", "Observation:"]  # never in the replayed text; their first characters often are
QUICK_TEXT_LINES = 2000  # --quick replays the corpus's first lines: encoding all of them takes a second


def _corpus() -> list[str]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    lines = []
    for path in sorted(glob.glob(os.path.join(root, "**", "*.md"), recursive=True)) + \
            sorted(glob.glob(os.path.join(root, "tpengine", "**", "*.py"), recursive=True)):
        with open(path, encoding="utf-8") as f:
            lines += [line for line in f.read().splitlines() if line.strip() and "###" not in line]
    return [line for line in lines if not any(stop.strip() in line for stop in STOPS)]


def _model(corpus: list[str], path: str) -> str:
    write_tiny_model(path, with_tokenizer=False, vocab_size=VOCAB, num_hidden_layers=1)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>").save_pretrained(path)
    return path


class ReplayExecutor:
    """Stands in for the ranks (the executor's face the engine steps through): step k samples replay[k] for
    every sequence of the batch."""

    closed = False

    def __init__(self, executor, replay: list[list[int]]):
        self.num_kvcache_blocks = executor.num_kvcache_blocks
        self.replay, self.step = replay, 0
        self.sampled: list[SamplerOutput] = []

    def submit(self, plan):
        tokens = self.replay[self.step % len(self.replay)]
        self.step += 1
        num_rows = len(plan.sampling)
        self.sampled.append(SamplerOutput(tokens[:num_rows], [None] * num_rows))

    def collect(self, plan):
        return self.sampled.pop(0)

    def check_open(self):
        pass

    def abandon(self):
        self.sampled.clear()

    def shutdown(self, graceful: bool = True):
        pass


def bench(llm, real_executor, prompts, replay, stream: bool, stop: list[str] | None, kind: RequestOutputKind,
          built_off_step: bool, warmup: int, steps: int) -> tuple[float, float]:
    """Median µs of a step, and of building its outputs apart (0 unless built_off_step)."""
    llm.executor = ReplayExecutor(real_executor, replay)
    params = SamplingParams(temperature=0.0, max_tokens=warmup + steps + 10, ignore_eos=True, stop=stop,
                            output_kind=kind)
    ids = [llm.add_request(prompt, params, stream=stream) for prompt in prompts]
    while llm.scheduler.waiting:  # prefill everything first
        llm.step()
    for _ in range(warmup):
        llm.step_reports().build()
    times, build_times = [], []
    gc.collect()
    for _ in range(steps):
        if built_off_step:
            started = time.perf_counter_ns()
            reports = llm.step_reports()
            built = time.perf_counter_ns()
            reports.build()
            times.append(built - started)
            build_times.append(time.perf_counter_ns() - built)
        else:
            started = time.perf_counter_ns()
            llm.step()
            times.append(time.perf_counter_ns() - started)
    assert llm.num_requests_running == len(prompts), "a request finished: the replayed text hit a stop string"
    for request_id in ids:
        llm.abort(request_id)
    llm.step()  # hand out the aborts
    llm.executor = real_executor
    return statistics.median(times) / 1000, statistics.median(build_times or [0]) / 1000


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2, help="rounds over the cases, alternating; each keeps its best")
    args = parse_with_quick(parser, argv, dict(seqs=6, steps=4, warmup=2, rounds=1))
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})  # one core: no migration noise

    corpus = _corpus()
    scratch = tempfile.TemporaryDirectory(prefix="bench_outputs_")  # removed when the script ends
    path = _model(corpus, scratch.name)
    rng = random.Random(0)
    n = args.seqs
    max_len = 1024 + args.warmup + args.steps + 16
    num_blocks = n * -(-max_len // BLOCK_SIZE)
    with LLM(path, kvcache_block_size=BLOCK_SIZE, num_kvcache_blocks=num_blocks, max_num_seqs=n,
             max_model_len=max_len, max_num_batched_tokens=1024 * n, attention_backend="torch") as llm:
        text_ids = llm.tokenizer.encode("\n".join(corpus[:QUICK_TEXT_LINES] if args.quick else corpus))
        prompts = [[rng.randrange(VOCAB - 1) for _ in range(rng.randint(100, 1024))] for _ in range(n)]
        # step k gives sequence i token (offset_i + k) of the text: each sequence reads its own passage
        offsets = [rng.randrange(len(text_ids) - 2 * args.steps) for _ in range(n)]
        replay = [[text_ids[(o + k) % len(text_ids)] for o in offsets] for k in range(args.warmup + args.steps + 64)]
        real = llm.executor
        cumulative, delta = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA
        cases = [("neither (generate())", False, None, cumulative, False),
                 ("streamed", True, None, cumulative, False),
                 ("stop strings", False, STOPS, cumulative, False),
                 ("streamed + stop strings", True, STOPS, cumulative, False),
                 ("streamed, delta outputs", True, None, delta, False),
                 ("streamed, delta outputs, built off the step (the server's)", True, None, delta, True),
                 ("streamed + stop strings, delta outputs", True, STOPS, delta, False)]
        results, builds = {}, {}
        for _ in range(args.rounds):  # alternate and keep the best of each: a noisy moment hurts no case alone
            for name, stream, stop, kind, built_off_step in cases:
                us, build_us = bench(llm, real, prompts, replay, stream, stop, kind, built_off_step, args.warmup,
                                     args.steps)
                if us < results.get(name, float("inf")):
                    results[name], builds[name] = us, build_us
    base = results[cases[0][0]]
    print(f"decode step of {n} sequences on rank 0 (schedule + postprocess + outputs), block size {BLOCK_SIZE}, "
          f"prompts 100..1024 tokens, {len(STOPS)} stop strings, median of {args.steps} steps after "
          f"{args.warmup} warm-up\n")
    print("| outputs | µs/step | µs/seq | over the baseline µs/step | outputs built apart, µs/step |")
    print("|---|---:|---:|---:|---:|")
    for name, *_, built_off_step in cases:
        apart = f"{builds[name]:.1f}" if built_off_step else ""
        print(f"| {name} | {results[name]:.1f} | {results[name] / n:.3f} | {results[name] - base:+.1f} | {apart} |")


if __name__ == "__main__":
    main()
