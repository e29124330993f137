"""Where a CPU tensor-parallel step's time goes: benchmarks/bench.py's workload (nano-vllm's shape, 64 sequences
of the CPU bench model by default, or --model) timed once at tp=1 and once at --tp, with every rank recording
when it enters and leaves each collective and each step phase.

The ranks' clocks are one (CLOCK_MONOTONIC), so the n-th collective of every rank can be lined up:
the earlier rank's wait is the later rank's arrival minus its own, and what follows until the first
rank leaves is the copy and sum. Rank 0 also reports its host phases (schedule, sample, postprocess),
and the other ranks how long they sat between steps waiting for the next one.

The recording wraps methods in every rank process (rank 0 here; the workers through a sitecustomize
module on PYTHONPATH, which they inherit): the engine itself is unchanged.

    .venv/bin/python tools/profile_tp_step.py --tp 2
    .venv/bin/python tools/profile_tp_step.py --quick      # seconds: bench.py --quick's workload and model
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from tpengine.bench.models import QUICK_MODEL, write_model
from tpengine.bench.quick import parse_with_quick
from tpengine.bench.results import load_average

# Installed in every rank process: wraps methods to record (tag, enter ns, leave ns), and dumps them to
# $TPENGINE_PROFILE_DIR/events_<rank>_<pid>.json when the rank's group shuts down (rank 0: on request).
RECORDER = '''
import functools, json, os, time
if os.environ.get("TPENGINE_PROFILE_DIR"):
    EVENTS = []
    def _wrap(cls, name, tag):
        inner = getattr(cls, name)
        @functools.wraps(inner)
        def recorded(*args, **kwargs):
            entered = time.perf_counter_ns()
            try:
                return inner(*args, **kwargs)
            finally:
                EVENTS.append((tag, entered, time.perf_counter_ns()))
        setattr(cls, name, recorded)
    import torch
    from tpengine.distributed import parallel_state
    from tpengine.distributed.shm import all_reduce as shm_all_reduce, ring as shm_ring
    from tpengine.engine import llm_engine, scheduler
    from tpengine.runner import model_runner, multiproc_executor, sampler
    for cls, name, tag in [(shm_all_reduce.ShmAllReduce, "all_reduce", "all-reduce"),
                           (shm_all_reduce.ShmAllReduce, "gather_to_first", "gather"),
                           (model_runner.ModelRunner, "execute", "forward"),
                           (shm_ring.ShmRingReader, "read", "wait for step"),
                           (sampler.Sampler, "__call__", "sample"),
                           (model_runner, "sample_vocab_parallel", "sample (own vocabulary slice)"),
                           (scheduler.Scheduler, "schedule", "schedule"),
                           (scheduler.Scheduler, "postprocess", "postprocess"),
                           (multiproc_executor.MultiprocExecutor, "send_to_workers", "send"),
                           (llm_engine.LLMEngine, "_step", "step")]:
        _wrap(cls, name, tag)
    def dump(rank):
        path = os.path.join(os.environ["TPENGINE_PROFILE_DIR"], f"events_{rank}_{os.getpid()}.json")
        with open(path, "w") as f:
            json.dump({"rank": rank, "threads": torch.get_num_threads(),
                       "affinity": sorted(os.sched_getaffinity(0)), "events": EVENTS}, f)
    parallel_state.dump_profile = dump
    _shutdown = parallel_state.TensorParallelGroup.shutdown
    def shutdown(self):
        if self.rank != 0:
            dump(self.rank)
        return _shutdown(self)
    parallel_state.TensorParallelGroup.shutdown = shutdown
'''

RUN_ONE = '''
import json, os, sys, time
from tpengine import LLM, SamplingParams
from tpengine.bench.workload import NANO_VLLM, QUICK, warm_up_workload
from tpengine.distributed import parallel_state
workload = {workload}
model = {model!r}
from tpengine.hf_config import load_hf_config  # not transformers' AutoConfig: a second of import, in every run
prompts, output_lens = workload.draw(load_hf_config(model).vocab_size)
llm = LLM(model, tensor_parallel_size={tp}, max_model_len=workload.max_input_len + workload.max_output_len,
          max_num_seqs={max_num_seqs})
for warm_prompts, warm_lens in warm_up_workload(prompts, output_lens):
    llm.generate(warm_prompts, [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True)
                                for n in warm_lens], use_tqdm=False)
params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True) for n in output_lens]
started = time.perf_counter_ns()
llm.generate(prompts, params, use_tqdm=False)
ended = time.perf_counter_ns()
with open(os.path.join(os.environ["TPENGINE_PROFILE_DIR"], "window.json"), "w") as f:
    json.dump({{"start": started, "end": ended, "tokens": sum(output_lens)}}, f)
parallel_state.dump_profile(0)
llm.shutdown()
'''


def run(tp: int, model: str, folder: str, quick: bool) -> tuple[dict, dict[int, dict]]:
    """One timed generate at tp in a fresh interpreter whose ranks all record; (window, events per rank)."""
    site = os.path.join(folder, "site")
    os.makedirs(site, exist_ok=True)
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(RECORDER)
    out = os.path.join(folder, f"tp{tp}")
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, TPENGINE_PROFILE_DIR=out,
               PYTHONPATH=os.pathsep.join([site, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    # bench.py's run: its workload, its max_num_seqs (4 with --quick) and its temperature
    code = RUN_ONE.format(workload="QUICK" if quick else 'NANO_VLLM["cpu"]', max_num_seqs=4 if quick else 512,
                          model=model, tp=tp)
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    with open(os.path.join(out, "window.json")) as f:
        window = json.load(f)
    ranks = {}
    for name in os.listdir(out):
        if name.startswith("events_"):
            with open(os.path.join(out, name)) as f:
                data = json.load(f)
            ranks[data["rank"]] = data
    return window, ranks


def ms(ns: float) -> str:
    return f"{ns / 1e6:,.1f} ms"


def report(tp: int, window: dict, ranks: dict[int, dict]) -> None:
    start, end = window["start"], window["end"]
    seconds = (end - start) / 1e9
    print(f"\n## tp={tp}: {seconds:.2f} s, {window['tokens'] / seconds:,.1f} output tok/s\n")
    inside = {rank: [e for e in data["events"] if start <= e[1] <= end] for rank, data in ranks.items()}
    steps = sum(1 for e in inside[0] if e[0] == "step")
    for rank, data in sorted(ranks.items()):
        totals: dict[str, list[float]] = {}
        for tag, entered, left in inside[rank]:
            totals.setdefault(tag, []).append(left - entered)
        phases = ", ".join(f"{tag} {ms(sum(t))} (median {statistics.median(t) / 1e3:,.0f} µs x {len(t)})"
                           for tag, t in sorted(totals.items()))
        print(f"- rank {rank} (torch threads {data['threads']}, CPUs {data['affinity']}): {phases}")
    if tp == 1:
        return
    collectives = {rank: [e for e in data["events"] if e[0] in ("all-reduce", "gather")]
                   for rank, data in ranks.items()}
    assert len({len(c) for c in collectives.values()}) == 1, "ranks ran different numbers of collectives"
    per_step = len(collectives[0]) // max(1, sum(1 for e in ranks[0]["events"] if e[0] == "step"))
    waits = {rank: 0 for rank in ranks}
    position_waits = {rank: [0] * per_step for rank in ranks}
    after_arrival = {"all-reduce": [], "gather": []}
    for n, calls in enumerate(zip(*(collectives[rank] for rank in sorted(ranks)))):
        if not start <= calls[0][1] <= end:
            continue
        last_arrival = max(c[1] for c in calls)
        for rank, (_, entered, _) in zip(sorted(ranks), calls):
            waits[rank] += last_arrival - entered
            position_waits[rank][n % per_step] += last_arrival - entered
        after_arrival[calls[0][0]].append(min(c[2] for c in calls) - last_arrival)
    print(f"\n{steps} steps, {per_step} collectives per step (the embedding's and two per layer all-reduces, then "
          f"the LM head's gather, or two small all-reduces where every rank samples its vocabulary slice)")
    for rank in sorted(ranks):
        first = position_waits[rank][0]
        print(f"- rank {rank} waits for the others in collectives: {ms(waits[rank])} "
              f"({100 * waits[rank] / (end - start):.1f}% of the run); at the step's first all-reduce {ms(first)}")
    for what, times in after_arrival.items():
        if times:
            print(f"- {what}: from the last rank's arrival to the first rank's return (copy and sum): total "
                  f"{ms(sum(times))}, median {statistics.median(times) / 1e3:,.1f} µs")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--model", help="checkpoint folder (default: bench.py's random-weight CPU model)")
    args = parse_with_quick(p, argv, {}, "bench.py --quick's workload and model")
    print(f"load average before {load_average()}")
    with tempfile.TemporaryDirectory(prefix="tpengine-profile-") as folder:
        model = args.model or write_model("cpu", os.path.join(folder, "model"), QUICK_MODEL if args.quick else None)
        for tp in (1, args.tp):
            report(tp, *run(tp, model, folder, args.quick))
    print(f"\nload average after {load_average()}")


if __name__ == "__main__":
    main()
