"""All-reduce between tensor-parallel ranks on one CPU host: the shared-memory all-reduce against gloo,
and end to end, benchmarks/bench.py's tpengine run at tp=2 against tp=1; each pair in the same run.

Latency: --tp rank processes (one torch thread each) join one gloo group and one shared-memory
all-reduce; for every size, rounds alternate --iters back-to-back float32 all-reduces through each;
rank 0 reports the median microseconds per call (every call is a full synchronisation of the ranks).
Then the same for the LM head's gather to rank 0 (--gather-bytes per rank, default a 64-row step of a
4,096-column vocabulary slice).

End to end (--end-to-end): benchmarks/bench.py's workload and model (defaults: 64 sequences of the CPU
bench model, sampling at temperature 0.6), tpengine alone, timed at tp=1 and at tp=2 alternately
--repeat times. Reported: each side's fastest and median run, and the median over rounds of tp=2's
rate over tp=1's in the same round (on a noisy machine the pairing cancels what drifts between rounds).

    .venv/bin/python benchmarks/bench_allreduce.py                       # latency, 128 KB and 19 MB
    .venv/bin/python benchmarks/bench_allreduce.py --end-to-end --repeat 3
    .venv/bin/python benchmarks/bench_allreduce.py --quick --end-to-end  # seconds: small sizes, bench.py --quick's run
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tpengine.bench.models import QUICK_MODEL, write_model
from tpengine.bench.quick import parse_with_quick
from tpengine.bench.results import git_revision, load_average, machine_line
from tpengine.bench.timing import time_generate
from tpengine.bench.workload import NANO_VLLM, QUICK
from tpengine.distributed.parallel_state import find_free_port
from tpengine.distributed.shm.all_reduce import DEFAULT_SLOT_BYTES, connect


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2, help="ranks for the latency runs (default 2)")
    p.add_argument("--sizes", type=int, nargs="+", default=[128 << 10, 19 << 20],
                   help="tensor sizes in bytes (default: 128 KB, a decode step's; 19 MB, a long prefill's)")
    p.add_argument("--gather-bytes", type=int, default=1 << 20, help="per rank, for the gather (default 1 MB)")
    p.add_argument("--iters", type=int, default=200, help="all-reduces per round and size (fewer for big sizes)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--slot-bytes", type=int, default=DEFAULT_SLOT_BYTES)
    p.add_argument("--end-to-end", action="store_true", help="also time benchmarks/bench.py's run at tp=1 and tp=2")
    p.add_argument("--repeat", type=int, default=2, help="end-to-end runs of each tp, alternating")
    return parse_with_quick(p, argv, dict(sizes=[4 << 10, 64 << 10], gather_bytes=16 << 10, iters=5, rounds=1,
                                          repeat=1), "--end-to-end times bench.py --quick's workload and model")


def time_calls(all_reduce, tensor: torch.Tensor, iters: int) -> list[float]:
    times = []
    for _ in range(iters):
        started = time.perf_counter()
        all_reduce(tensor)
        times.append(time.perf_counter() - started)
    return times


def gloo_gather(tensor: torch.Tensor) -> None:
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())] if dist.get_rank() == 0 else None
    dist.gather(tensor, gathered, dst=0)


def latency_rank(rank: int, args, port: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.tp)
    shm, line = connect(rank, args.tp, dist.all_reduce, slot_bytes=args.slot_bytes)
    assert shm is not None, line
    cases = [("all-reduce", size, shm.all_reduce, dist.all_reduce) for size in args.sizes]
    cases.append(("gather to rank 0", args.gather_bytes, shm.gather_to_first, gloo_gather))
    for what, size, through_shm, through_gloo in cases:
        tensor = torch.randn(size // 4)
        iters = max(5, min(args.iters, args.iters * (1 << 20) // size))
        times = {"shm": [], "gloo": []}
        for _ in range(args.rounds):
            for name, call in (("shm", through_shm), ("gloo", through_gloo)):
                time_calls(call, tensor, 3)  # warm
                times[name] += time_calls(call, tensor, iters)
        if rank == 0:
            results.append((what, size, statistics.median(times["shm"]), statistics.median(times["gloo"])))
    shm.close()
    dist.destroy_process_group()


def measure_latency(args) -> list[tuple[int, float, float]]:
    with mp.Manager() as manager:
        results = manager.list()
        mp.spawn(latency_rank, args=(args, find_free_port(), results), nprocs=args.tp)
        return list(results)


def measure_end_to_end(repeat: int, quick: bool) -> tuple[dict[int, list[float]], int]:
    """Output tok/s of every run, by tp (round order), and the useful output tokens of one run."""
    import tempfile

    from transformers import AutoConfig

    from tpengine import LLM

    workload = QUICK if quick else NANO_VLLM["cpu"]
    with tempfile.TemporaryDirectory(prefix="tpengine-bench-") as tmp:
        model = write_model("cpu", os.path.join(tmp, "model"), QUICK_MODEL if quick else None)
        prompts, output_lens = workload.draw(AutoConfig.from_pretrained(model).vocab_size)
        useful = sum(output_lens)
        rates: dict[int, list[float]] = {1: [], 2: []}
        num_threads = torch.get_num_threads()
        for round_ in range(repeat):
            for tp in (1, 2):
                # bench.py --skip-hf's engine: float32, its max_num_seqs (4 with --quick), temperature 0.6
                with LLM(model, tensor_parallel_size=tp, dtype="float32", device="cpu",
                         max_model_len=workload.max_input_len + workload.max_output_len,
                         max_num_seqs=4 if quick else 512) as llm:
                    seconds, _ = time_generate(llm, prompts, output_lens, temperature=0.6)
                torch.set_num_threads(num_threads)
                rates[tp].append(useful / seconds)
                print(f"[round {round_ + 1}/{repeat}] tp={tp}: {seconds:.2f}s ({useful / seconds:,.1f} tok/s), "
                      f"load {load_average()}", file=sys.stderr)
    return rates, useful


def main(argv=None) -> None:
    args = parse_args(argv)
    load_before = load_average()
    print(f"machine: {machine_line('cpu', torch.get_num_threads())}")
    print(f"revision {git_revision()}; load average before {load_before}")
    print(f"\nlatency, {args.tp} ranks, float32, slot {args.slot_bytes >> 10} KB, median µs per call:\n")
    print("| collective | size per rank | shared memory | gloo | speed-up |")
    print("|---|---:|---:|---:|---:|")
    for what, size, shm, gloo in measure_latency(args):
        label = f"{size >> 20} MB" if size >= 1 << 20 else f"{size >> 10} KB" if size >= 1 << 10 else f"{size} B"
        print(f"| {what} | {label} | {shm * 1e6:,.1f} | {gloo * 1e6:,.1f} | {gloo / shm:.1f}x |")
    if args.end_to_end:
        rates, useful = measure_end_to_end(args.repeat, args.quick)
        print(f"\nend to end, benchmarks/bench.py --skip-hf{' --quick' if args.quick else ''} workload ({useful} output "
              f"tokens), {args.repeat} rounds:\n")
        print("| tp | best tok/s | median tok/s | slowest tok/s |")
        print("|---:|---:|---:|---:|")
        for tp, runs in rates.items():
            print(f"| {tp} | {max(runs):,.1f} | {statistics.median(runs):,.1f} | {min(runs):,.1f} |")
        paired = [two / one for one, two in zip(rates[1], rates[2])]
        print(f"\ntp=2 / tp=1: best {max(rates[2]) / max(rates[1]):.3f}x, medians "
              f"{statistics.median(rates[2]) / statistics.median(rates[1]):.3f}x; same-round ratios "
              f"{', '.join(f'{r:.3f}' for r in paired)} (median {statistics.median(paired):.3f}x)")
    print(f"\nload average after {load_average()}")


if __name__ == "__main__":
    main()
