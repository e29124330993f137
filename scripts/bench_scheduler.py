"""Bookkeeping cost of one decode step: our Scheduler + BlockManager vs nano-vllm's, no model.

One decode step here is schedule() plus postprocess() with fake sampled token ids: the
Python work rank 0 does between two forward passes. The baseline is a re-implementation of
nano-vllm's pure-Python Sequence / BlockManager / Scheduler as the seed design describes
them (deque free queue, deque.remove when a prefix hit takes a freed block back), run on
the same workload so the comparison is honest.

Also measures taking freed blocks back on a prefix hit: a 1024-token prompt whose blocks
sit at the tail of a 65,536-block free queue (16-token blocks).

    .venv/bin/python scripts/bench_scheduler.py [--steps 200] [--warmup 50] [--sizes 64 256 512]
"""
import argparse
import gc
import os
import random
import statistics
import time
from collections import deque
from copy import copy
from enum import Enum, auto
from itertools import count

import numpy as np
import xxhash

from tpengine.engine.block_manager import BlockManager
from tpengine.engine.scheduler import Scheduler
from tpengine.engine.sequence import Sequence
from tpengine.sampling_params import SamplingParams

BLOCK_SIZE = 256
EOS = 0
FAKE_TOKEN = 7  # never EOS, so nothing finishes


# --- baseline: nano-vllm's engine, as the seed describes it ---------------------------------

class NanoStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class NanoSequence:
    block_size = 256
    counter = count()

    def __init__(self, token_ids, temperature=1.0, max_tokens=64, ignore_eos=False):
        self.seq_id = next(NanoSequence.counter)
        self.status = NanoStatus.WAITING
        self.token_ids = copy(token_ids)
        self.last_token = token_ids[-1]
        self.num_tokens = len(self.token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.num_cached_tokens = 0
        self.num_scheduled_tokens = 0
        self.is_prefill = True
        self.block_table = []
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.ignore_eos = ignore_eos

    def __len__(self):
        return self.num_tokens

    @property
    def num_completion_tokens(self):
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_blocks(self):
        return (self.num_tokens + self.block_size - 1) // self.block_size

    def block(self, i):
        assert 0 <= i < self.num_blocks
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append_token(self, token_id):
        self.token_ids.append(token_id)
        self.last_token = token_id
        self.num_tokens += 1


class NanoBlock:
    def __init__(self, block_id):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids = []

    def update(self, hash, token_ids):
        self.hash = hash
        self.token_ids = token_ids

    def reset(self):
        self.ref_count = 1
        self.hash = -1
        self.token_ids = []


class NanoBlockManager:
    def __init__(self, num_blocks, block_size):
        self.block_size = block_size
        self.blocks = [NanoBlock(i) for i in range(num_blocks)]
        self.hash_to_block_id = {}
        self.free_block_ids = deque(range(num_blocks))
        self.used_block_ids = set()

    @classmethod
    def compute_hash(cls, token_ids, prefix=-1):
        h = xxhash.xxh64()
        if prefix != -1:
            h.update(prefix.to_bytes(8, "little"))
        h.update(np.array(token_ids).tobytes())
        return h.intdigest()

    def _allocate_block(self):
        block_id = self.free_block_ids.popleft()
        block = self.blocks[block_id]
        assert block.ref_count == 0
        if block.hash != -1 and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
        block.reset()
        self.used_block_ids.add(block_id)
        return block_id

    def _deallocate_block(self, block_id):
        assert self.blocks[block_id].ref_count == 0
        self.used_block_ids.remove(block_id)
        self.free_block_ids.append(block_id)

    def can_allocate(self, seq):
        h = -1
        num_cached_blocks = 0
        num_new_blocks = seq.num_blocks
        for i in range(seq.num_blocks - 1):
            token_ids = seq.block(i)
            h = self.compute_hash(token_ids, h)
            block_id = self.hash_to_block_id.get(h, -1)
            if block_id == -1 or self.blocks[block_id].token_ids != token_ids:
                break
            num_cached_blocks += 1
            if block_id in self.used_block_ids:
                num_new_blocks -= 1
        if len(self.free_block_ids) < num_new_blocks:
            return -1
        return num_cached_blocks

    def allocate(self, seq, num_cached_blocks):
        h = -1
        for i in range(num_cached_blocks):
            h = self.compute_hash(seq.block(i), h)
            block_id = self.hash_to_block_id[h]
            block = self.blocks[block_id]
            if block_id in self.used_block_ids:
                block.ref_count += 1
            else:
                block.ref_count = 1
                self.free_block_ids.remove(block_id)  # O(len(free queue))
                self.used_block_ids.add(block_id)
            seq.block_table.append(block_id)
        for i in range(num_cached_blocks, seq.num_blocks):
            seq.block_table.append(self._allocate_block())
        seq.num_cached_tokens = num_cached_blocks * self.block_size

    def deallocate(self, seq):
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._deallocate_block(block_id)
        seq.num_cached_tokens = 0
        seq.block_table.clear()

    def can_append(self, seq):
        return len(self.free_block_ids) >= (len(seq) % self.block_size == 1)

    def may_append(self, seq):
        if len(seq) % self.block_size == 1:
            seq.block_table.append(self._allocate_block())

    def hash_blocks(self, seq):
        start = seq.num_cached_tokens // self.block_size
        end = (seq.num_cached_tokens + seq.num_scheduled_tokens) // self.block_size
        if start == end:
            return
        h = self.blocks[seq.block_table[start - 1]].hash if start > 0 else -1
        for i in range(start, end):
            block = self.blocks[seq.block_table[i]]
            token_ids = seq.block(i)
            h = self.compute_hash(token_ids, h)
            block.update(h, token_ids)
            self.hash_to_block_id[h] = block.block_id


class NanoScheduler:
    def __init__(self, num_blocks, block_size, max_num_seqs, max_num_batched_tokens, eos):
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos = eos
        self.block_size = block_size
        self.block_manager = NanoBlockManager(num_blocks, block_size)
        self.waiting = deque()
        self.running = deque()

    def add(self, seq):
        self.waiting.append(seq)

    def schedule(self):
        scheduled_seqs = []
        num_batched_tokens = 0
        while self.waiting and len(scheduled_seqs) < self.max_num_seqs:
            seq = self.waiting[0]
            remaining = self.max_num_batched_tokens - num_batched_tokens
            if remaining == 0:
                break
            if not seq.block_table:
                num_cached_blocks = self.block_manager.can_allocate(seq)
                if num_cached_blocks == -1:
                    break
                num_tokens = seq.num_tokens - num_cached_blocks * self.block_size
            else:
                num_tokens = seq.num_tokens - seq.num_cached_tokens
            if remaining < num_tokens and scheduled_seqs:
                break
            if not seq.block_table:
                self.block_manager.allocate(seq, num_cached_blocks)
            seq.num_scheduled_tokens = min(num_tokens, remaining)
            num_batched_tokens += seq.num_scheduled_tokens
            if seq.num_cached_tokens + seq.num_scheduled_tokens == seq.num_tokens:
                seq.status = NanoStatus.RUNNING
                self.waiting.popleft()
                self.running.append(seq)
            scheduled_seqs.append(seq)
        if scheduled_seqs:
            return scheduled_seqs, True

        while self.running and len(scheduled_seqs) < self.max_num_seqs:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                seq.num_scheduled_tokens = 1
                seq.is_prefill = False
                self.block_manager.may_append(seq)
                scheduled_seqs.append(seq)
        assert scheduled_seqs
        self.running.extendleft(reversed(scheduled_seqs))
        return scheduled_seqs, False

    def preempt(self, seq):
        seq.status = NanoStatus.WAITING
        seq.is_prefill = True
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def postprocess(self, seqs, token_ids, is_prefill):
        for seq, token_id in zip(seqs, token_ids):
            self.block_manager.hash_blocks(seq)
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            if is_prefill and seq.num_cached_tokens < seq.num_tokens:
                continue
            seq.append_token(token_id)
            if (not seq.ignore_eos and token_id == self.eos) or seq.num_completion_tokens == seq.max_tokens:
                seq.status = NanoStatus.FINISHED
                self.block_manager.deallocate(seq)
                self.running.remove(seq)


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


def bench_ours(prompts, warmup: int, steps: int) -> float:
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
    seqs, is_prefill = scheduler.schedule()
    assert is_prefill and len(seqs) == n
    scheduler.postprocess(seqs, token_ids)

    def step():
        seqs, is_prefill = scheduler.schedule()
        scheduler.postprocess(seqs, token_ids)

    for _ in range(warmup):
        step()
    us = _time_decode_steps(step, steps)
    assert len(scheduler.running) == n and not scheduler.waiting and scheduler.num_preemptions == 0
    return us


def bench_nano(prompts, warmup: int, steps: int) -> float:
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
    manager.deallocate(first)
    times = []
    gc.collect()
    for _ in range(repeats):
        seq = make_seq(prompt)
        started = time.perf_counter_ns()
        num_cached_blocks = manager.can_allocate(seq)
        manager.allocate(seq, num_cached_blocks)
        times.append(time.perf_counter_ns() - started)
        assert num_cached_blocks == len(prompt) // 16 - 1  # the last block is never looked up
        manager.deallocate(seq)  # back to the tail, reversed: the next take-back is as far away
    return statistics.median(times) / 1e6


def bench_take_back(repeats: int) -> tuple[float, float]:
    num_blocks, block_size = 65_536, 16
    NanoSequence.block_size = block_size
    ours = _bench_take_back(BlockManager(num_blocks, block_size), lambda p: Sequence(p, block_size=block_size),
                            repeats)
    nano = _bench_take_back(NanoBlockManager(num_blocks, block_size), lambda p: NanoSequence(p), repeats)
    NanoSequence.block_size = BLOCK_SIZE
    return ours, nano


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 512])
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--take-back-repeats", type=int, default=20)
    args = parser.parse_args()

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
