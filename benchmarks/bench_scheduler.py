"""Bookkeeping cost of one decode step: our Scheduler + BlockManager vs nano-vllm's, no model.

One decode step here is schedule() plus postprocess() with fake sampled token ids: the
Python work rank 0 does between two forward passes (ours builds the step's message inside
schedule()). The baseline is a re-implementation of nano-vllm's pure-Python Sequence /
BlockManager / Scheduler as the seed design describes them (deque free queue, deque.remove
when a prefix hit takes a freed block back), run on the same workload so the comparison is honest.

Rank 0's whole host step adds the message's bytes for the workers and the step's outputs: ours
encodes the StepMessage with msgspec (a decode row is its id, token and context length; the block
tables stay on the workers), nano-vllm pickles the scheduled Sequences (its tensor-parallel call),
and both collect the finished sequences' outputs (none finish here).

Also measures taking freed blocks back on a prefix hit: a 1024-token prompt whose blocks
sit at the tail of a 65,536-block free queue (16-token blocks).

    .venv/bin/python benchmarks/bench_scheduler.py [--steps 200] [--warmup 50] [--sizes 64 256 512]
    .venv/bin/python benchmarks/bench_scheduler.py --quick     # seconds: 8 and 32 sequences, 10 steps
"""
import argparse
import gc
import os
import pickle
import random
import statistics
import time

from nano_baseline import NanoBlockManager, NanoScheduler, NanoSequence, NanoStatus
from tpengine.bench.quick import parse_with_quick
from tpengine.distributed.messages import encode
from tpengine.engine.block_manager import BlockManager
from tpengine.engine.scheduler import Scheduler
from tpengine.engine.sequence import Sequence
from tpengine.sampling_params import SamplingParams

BLOCK_SIZE = 256
EOS = 0
FAKE_TOKEN = 7  # never EOS, so nothing finishes


# --- decode-step benchmark ------------------------------------------------------------------

def _prompts(num_seqs: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 32000) for _ in range(rng.randint(100, 1024))] for _ in range(num_seqs)]


def _time_decode_steps(step, num_steps: int) -> float:
    """Median wall time of one call to step(), in microseconds."""
    times = []
    gc.collect()
    for _ in range(num_steps):
        started = time.perf_counter_ns()
        step()
        times.append(time.perf_counter_ns() - started)
    return statistics.median(times) / 1000


def _max_len(num_steps: int) -> int:
    # The longest prompt plus its prefill token plus one token per step, with a margin.
    return 1024 + 1 + num_steps + 16


def _num_blocks(num_seqs: int, num_steps: int) -> int:
    # Enough for every sequence at its longest: nothing is ever preempted.
    return num_seqs * ((_max_len(num_steps) + BLOCK_SIZE - 1) // BLOCK_SIZE)


def bench_ours(prompts, warmup: int, steps: int, whole_step: bool = False) -> float:
    """µs per decode step: schedule + postprocess, or (whole_step) also the message encoded for the workers
    and the finished sequences' outputs collected."""
    n = len(prompts)
    max_len = _max_len(warmup + steps)
    scheduler = Scheduler(
        num_kvcache_blocks=_num_blocks(n, warmup + steps), kvcache_block_size=BLOCK_SIZE,
        max_num_seqs=n, max_num_batched_tokens=1024 * n, max_model_len=max_len,
        eos_token_ids=frozenset([EOS]))
    params = SamplingParams(max_tokens=max_len)
    for prompt in prompts:
        scheduler.add(Sequence(prompt, params, block_size=BLOCK_SIZE))
    token_ids = [FAKE_TOKEN] * n
    plan = scheduler.schedule()
    assert len(plan.message.prefill) == n and not plan.num_decode
    scheduler.postprocess(plan, token_ids)

    def step():
        scheduler.postprocess(scheduler.schedule(), token_ids)

    def whole():
        plan = scheduler.schedule()
        encode(plan.message)
        sampled, finished = scheduler.postprocess(plan, token_ids)
        return [(seq.seq_id, seq.completion_token_ids) for seq in finished]

    step = whole if whole_step else step

    for _ in range(warmup):
        step()
    us = _time_decode_steps(step, steps)
    assert len(scheduler.running) == n and not scheduler.waiting and scheduler.num_preemptions == 0
    return us


def bench_nano(prompts, warmup: int, steps: int, whole_step: bool = False) -> float:
    n = len(prompts)
    NanoSequence.block_size = BLOCK_SIZE
    scheduler = NanoScheduler(_num_blocks(n, warmup + steps), BLOCK_SIZE, n, 1024 * n, EOS)
    for prompt in prompts:
        scheduler.add(NanoSequence(prompt, max_tokens=1 << 30))
    token_ids = [FAKE_TOKEN] * n
    seqs, is_prefill = scheduler.schedule()
    assert is_prefill and len(seqs) == n
    scheduler.postprocess(seqs, token_ids, is_prefill)

    def step():
        seqs, is_prefill = scheduler.schedule()
        scheduler.postprocess(seqs, token_ids, is_prefill)

    def whole():  # nano-vllm's LLMEngine.step with its tensor-parallel call's pickle
        seqs, is_prefill = scheduler.schedule()
        pickle.dumps(["run", seqs, is_prefill])
        scheduler.postprocess(seqs, token_ids, is_prefill)
        return [(seq.seq_id, seq.token_ids[seq.num_prompt_tokens:]) for seq in seqs if seq.status == NanoStatus.FINISHED]

    step = whole if whole_step else step
    for _ in range(warmup):
        step()
    us = _time_decode_steps(step, steps)
    assert len(scheduler.running) == n and not scheduler.waiting
    return us


# --- prefix take-back benchmark -------------------------------------------------------------

def _bench_take_back(manager, make_seq, repeats: int) -> float:
    """Median ms for can_allocate + allocate of a prompt whose blocks are all freed at the queue tail."""
    prompt = list(range(1, 1025))
    first = make_seq(prompt)
    manager.allocate(first, manager.can_allocate(first))
    first.num_scheduled_tokens = len(prompt)
    manager.hash_blocks(first)  # as postprocess does after the prefill step
    whole_blocks = first.block_table[:len(prompt) // 16 - 1]  # the last block is never hit as a whole
    manager.deallocate(first)
    times = []
    gc.collect()
    for _ in range(repeats):
        seq = make_seq(prompt)
        started = time.perf_counter_ns()
        manager.allocate(seq, manager.can_allocate(seq))  # ours also copies the last block's head
        times.append(time.perf_counter_ns() - started)
        assert seq.block_table[:len(whole_blocks)] == whole_blocks
        if hasattr(manager, "release_copy_sources"):
            manager.release_copy_sources()  # as postprocess does once the step ran
        manager.deallocate(seq)  # back to the tail, reversed: the next take-back is as far away
    return statistics.median(times) / 1e6


def bench_take_back(repeats: int) -> tuple[float, float]:
    num_blocks, block_size = 65_536, 16
    NanoSequence.block_size = block_size
    ours = _bench_take_back(BlockManager(num_blocks, block_size), lambda p: Sequence(p, SamplingParams(), block_size),
                            repeats)
    nano = _bench_take_back(NanoBlockManager(num_blocks, block_size), lambda p: NanoSequence(p), repeats)
    NanoSequence.block_size = BLOCK_SIZE
    return ours, nano


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 512])
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--take-back-repeats", type=int, default=20)
    args = parse_with_quick(parser, argv, dict(sizes=[8, 32], warmup=2, steps=10, take_back_repeats=2))

    pinned = "no"
    if hasattr(os, "sched_setaffinity"):
        cpu = sorted(os.sched_getaffinity(0))[-1]
        os.sched_setaffinity(0, {cpu})  # one core: no migration noise
        pinned = f"cpu {cpu}"
    print(f"decode step = schedule() + postprocess(), block size {BLOCK_SIZE}, prompts 100..1024 tokens, "
          f"median of {args.steps} steps after {args.warmup} warm-up; pinned: {pinned}\n")

    print("| running seqs | ours µs/step | ours µs/seq | nano-vllm µs/step | nano-vllm µs/seq | speed-up |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in args.sizes:
        prompts = _prompts(n, seed=n)
        # Alternate and keep the best of each, so a noisy moment hurts neither side alone.
        ours, nano = [], []
        for _ in range(2):
            ours.append(bench_ours(prompts, args.warmup, args.steps))
            nano.append(bench_nano(prompts, args.warmup, args.steps))
        ours, nano = min(ours), min(nano)
        print(f"| {n} | {ours:.1f} | {ours / n:.3f} | {nano:.1f} | {nano / n:.3f} | {nano / ours:.2f}x |")

    print("\nrank 0's whole host step: schedule + the message encoded for the workers + postprocess + outputs\n")
    print("| running seqs | ours µs/step | nano-vllm µs/step | speed-up |")
    print("|---:|---:|---:|---:|")
    for n in args.sizes:
        prompts = _prompts(n, seed=n)
        ours, nano = [], []
        for _ in range(2):
            ours.append(bench_ours(prompts, args.warmup, args.steps, whole_step=True))
            nano.append(bench_nano(prompts, args.warmup, args.steps, whole_step=True))
        ours, nano = min(ours), min(nano)
        print(f"| {n} | {ours:.1f} | {nano:.1f} | {nano / ours:.2f}x |")

    ours_ms, nano_ms = bench_take_back(args.take_back_repeats)
    print("\nprefix hit on freed blocks: 1024-token prompt (63 blocks taken back), 65,536 blocks of 16 tokens, "
          "can_allocate + allocate\n")
    print("| free queue | ms |")
    print("|---|---:|")
    print(f"| ours (OrderedDict, O(1) take-back) | {ours_ms:.3f} |")
    print(f"| nano-vllm (deque.remove, O(n)) | {nano_ms:.3f} |")
    print(f"\nspeed-up {nano_ms / ours_ms:.0f}x")


if __name__ == "__main__":
    main()
