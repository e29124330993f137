"""CPU decode steps three ways in one engine: eager, replayed with its ops called from Python, replayed from C++.

One engine decodes `batch` sequences (208-token prompts, greedy, ignore_eos); the timed llm.step()s run in blocks of
--block steps, the three ways in turn (the order rotating each round), so all three share the same moments of a
noisy machine, the same weights and the same growing contexts:
- eager: the model's forward in Python (the engine's replays switched off for the block);
- Python replay: the recorded ops of runner/cpu_replay.py called one by one from Python (as before op_replay.cpp);
- C++ replay: the same ops called from kernels/cpu/op_replay.cpp (what the engine does).
The figure per way is the median step over all its blocks; the speed-ups are of those medians.

    .venv/bin/python benchmarks/bench_cpu_replay.py                                   # LOW_BATCH_MODEL, float32
    .venv/bin/python benchmarks/bench_cpu_replay.py --model ~/.cache/tpengine-bench/qwen3_0_6b_model --quantization int8
    .venv/bin/python benchmarks/bench_cpu_replay.py --quick                           # seconds
"""
import argparse
import os
import statistics
import tempfile
import time

import torch

from tpengine.bench.models import LOW_BATCH_MODEL, QUICK_MODEL, write_model
from tpengine.bench.quick import parse_with_quick
from tpengine.bench.results import machine_line
from tpengine import LLM, SamplingParams
from tpengine.runner.decode_path import EagerDecode, ReplayedDecode

WAYS = ("eager", "Python replay", "C++ replay")


def set_way(runner, replays, programs: dict, way: str) -> None:
    runner.decode_path = EagerDecode(runner.model) if way == "eager" else ReplayedDecode(runner.model, replays)
    for rows, replay in replays.replays.items():
        if replay is not None:
            replay.program = programs[rows] if way == "C++ replay" else None


def measure(llm, batch: int, args) -> dict[str, float]:
    """Median ms of a decode step of `batch` sequences, per way."""
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    ids = [llm.add_request([(7 * i + j) % 5000 + 1 for j in range(208)], params) for i in range(batch)]
    for _ in range(args.warmup):
        llm.step()
    runner = llm.executor.runner
    replays = runner.decode_path.replays
    if replays is None or replays.replays.get(batch) is None:
        raise SystemExit(f"decode steps of {batch} rows are not replayed here (the engine logs why)")
    programs = {rows: replay.program for rows, replay in replays.replays.items() if replay is not None}
    if programs[batch] is None:
        raise SystemExit("the replay calls its ops from Python only: kernels/cpu/op_replay.cpp is not built here")
    times = {way: [] for way in WAYS}
    for round_ in range(args.rounds):
        for way in WAYS[round_ % 3:] + WAYS[:round_ % 3]:
            set_way(runner, replays, programs, way)
            for _ in range(args.block):
                started = time.perf_counter()
                llm.step()
                times[way].append(time.perf_counter() - started)
    set_way(runner, replays, programs, "C++ replay")
    for request_id in ids:
        llm.abort(request_id)
    llm.step()
    return {way: statistics.median(values) * 1e3 for way, values in times.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder (default: bench_low_batch.py's random-weight model)")
    parser.add_argument("--quantization", choices=("int8", "int4"), help="online quantization of the weights")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=12, help="blocks per way (default 12)")
    parser.add_argument("--block", type=int, default=5, help="steps per block (default 5)")
    parser.add_argument("--warmup", type=int, default=8, help="untimed steps first (the prefill, the recording)")
    args = parse_with_quick(parser, argv, dict(batches=[1, 2], rounds=3, block=2, warmup=3))
    with tempfile.TemporaryDirectory(prefix="bench_cpu_replay_") as tmp:
        shape = QUICK_MODEL if args.quick else LOW_BATCH_MODEL
        path = args.model or write_model("cpu", os.path.join(tmp, "model"), shape)
        max_len = 208 + args.warmup + args.rounds * 3 * args.block + 16
        with LLM(path, quantization=args.quantization, tensor_parallel_size=args.tp, max_model_len=max_len,
                 enable_prefix_caching=False, max_num_seqs=max(args.batches)) as llm:
            results = {batch: measure(llm, batch, args) for batch in args.batches}
    print(machine_line("cpu", torch.get_num_threads()))
    shape = "QUICK_MODEL" if args.quick else "LOW_BATCH_MODEL"
    print(f"model {args.model or shape + ' (random weights)'}, {args.quantization or 'unquantized'}, tp {args.tp}; "
          f"median decode step of {args.rounds} blocks of {args.block} steps per way, the ways in turn\n")
    print("| batch | eager ms | Python replay ms | C++ replay ms | C++ vs Python replay | C++ replay vs eager |")
    print("|---:|---:|---:|---:|---:|---:|")
    for batch, ms in results.items():
        eager, python, cpp = (ms[way] for way in WAYS)
        print(f"| {batch} | {eager:.2f} | {python:.2f} | {cpp:.2f} | {python / cpp:.3f}x | {eager / cpp:.3f}x |")


if __name__ == "__main__":
    main()
