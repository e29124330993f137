"""Per-step control-plane cost: rank 0's scheduled sequences -> decoded messages on every worker.

Measures, for one engine step, what it costs to get the scheduler's output (a list of
``Sequence`` objects) to every worker process as decoded objects, for two designs:

* ours: the scheduler's step message (``Scheduler._plan``: the decode rows as three packed int64 columns,
  sequence id, token and context length, the block tables staying on the workers between steps) + msgspec
  ``encode`` on rank 0,
  ``ShmRingWriter.write`` into the shared-memory ring, ``ShmRingReader.read`` + ``decode_control`` +
  ``BlockTables.update`` (the step's table changes) on each worker;
* simple (nano-vllm, seed section 3.1/3.6): ``pickle.dumps(["run", seqs, is_prefill])`` of
  whole Sequence objects slimmed by their ``__getstate__``, copied behind a 4-byte length
  prefix into one ``multiprocessing.shared_memory`` buffer, each worker woken by its own
  ``multiprocessing.Event``, then ``pickle.loads`` straight from the buffer.

Workloads: decode batches of 64 / 256 / 512 sequences (context 100..2048 tokens, 256-token
blocks, so 1-8 block-table entries) and one 16,384-token prefill, built as real
``tpengine.engine.sequence.Sequence`` objects (ours) and as a copy of the seed's Sequence
(baseline) from the same random tokens and block tables.

Reported per case:

* message bytes, encode µs, decode µs: in-process microbenchmarks (best of many short runs);
* worker inputs µs (decode cases): what a worker then makes of the message, the forward's input tensors
  (ours: ``InputBuilder.build``; simple: nano-vllm's ``prepare_decode`` on the unpickled sequences);
* memcpy floor: one memoryview slice assignment of that many bytes into shared memory;
* end to end µs per step (median, p90): rank 0 starts encoding -> every reader has decoded
  and acknowledged, with 1 and 3 real reader processes (forkserver). Both designs acknowledge
  the same way: each reader stores its step count in its own cache line of a second
  SharedMemory, which rank 0 polls in a sched_yield spin loop (so the ack adds no sleep
  quantum to either design);
* wake-up floor: the same round trip with a 1-byte message and no decoding, per transport.

With 1 reader, rank 0 is pinned to CPU 0 and the reader to CPU 1 (when there are 2+ CPUs);
with more readers than spare CPUs nothing is pinned and the processes share the cores.

    .venv/bin/python benchmarks/bench_control_plane.py [--quick] [--steps 300] [--warmup 50]
        [--readers 1 3] [--gap-us 0] [--no-pin]

``--quick`` (20 steps after 5, 3 timeit runs, 1 reader) is a smoke run in seconds: what tests/benchmarks runs.

``--gap-us`` makes rank 0 sleep that long between steps (standing in for the forward pass,
sampling and scheduling), so readers sit idle waiting for the next message as workers do in
an engine; with the default 0, steps run back to back and readers are still busy-polling.
"""
import argparse
import multiprocessing as mp
import os
import pickle
import random
import statistics
import time
import timeit
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory

import torch

from nano_baseline import NanoSequence, nano_prepare_decode
from tpengine.bench.quick import parse_with_quick
from tpengine.distributed.messages import BlockTable, StepEnvelope, StepMessage, decode_control, encode, int_list
from tpengine.distributed.shm.ring import ShmRingReader, ShmRingWriter
from tpengine.engine.scheduler import Scheduler
from tpengine.engine.sequence import Sequence
from tpengine.runner.block_tables import BlockTables
from tpengine.runner.inputs import InputBuilder
from tpengine.sampling_params import SamplingParams

BLOCK_SIZE = 256
VOCAB_SIZE = 151_936        # Qwen-sized vocabulary: token ids take 3-5 bytes on the wire
NUM_KV_BLOCKS = 8_192       # block ids drawn from this pool
SIMPLE_SHM_BYTES = 1 << 20  # nano-vllm's buffer size
TIMEOUT_S = 60.0            # generous: the first step also waits for the readers to start
STOP = b""                  # an empty message tells a reader to exit


# --- workloads --------------------------------------------------------------------------------

@dataclass
class Case:
    name: str
    is_prefill: bool
    ours: list          # tpengine Sequences, as the scheduler schedules them
    simple: list        # NanoSequences in the same state
    scheduler: Scheduler

    def encode_ours(self) -> bytes:
        if self.is_prefill:
            for seq in self.ours:
                seq.on_workers = False  # admitted this step: its whole table goes with it
            plan = self.scheduler._plan([], [], self.ours)
        else:  # running: the workers hold its table from earlier steps
            plan = self.scheduler._plan(self.ours, [], [])
        return encode(StepEnvelope(plan.message))  # as the executor sends it

    def encode_simple(self) -> bytes:
        return pickle.dumps(["run", self.simple, self.is_prefill])  # nano-vllm's write_shm


def scheduled_like(new_seq: Callable[[list[int]], object], token_ids: list[int], block_table: list[int],
                   is_prefill: bool):
    """A sequence made by new_seq(prompt) in the state the scheduler hands to the model runner."""
    if is_prefill:  # a fresh prompt, prefilled whole
        seq = new_seq(token_ids)
        seq.num_scheduled_tokens = len(token_ids)
    else:           # decoding: every token but the last one sampled is in the cache
        seq = new_seq(token_ids[:-1])
        seq.num_cached_tokens = len(token_ids) - 1
        seq.append_token(token_ids[-1])
        seq.num_scheduled_tokens = 1
    seq.block_table = list(block_table)
    return seq


def make_case(name: str, lengths: list[int], is_prefill: bool, rng: random.Random) -> Case:
    free_blocks = rng.sample(range(NUM_KV_BLOCKS), NUM_KV_BLOCKS)
    params = SamplingParams()
    scheduler = Scheduler(num_kvcache_blocks=NUM_KV_BLOCKS, kvcache_block_size=BLOCK_SIZE, max_num_seqs=1024,
                          max_num_batched_tokens=16_384, max_model_len=16_384, eos_token_ids=frozenset())
    ours, simple = [], []
    for length in lengths:
        token_ids = [rng.randrange(VOCAB_SIZE) for _ in range(length)]
        block_table = [free_blocks.pop() for _ in range(-(-length // BLOCK_SIZE))]

        def new_seq(prompt):
            seq = Sequence(prompt, params, BLOCK_SIZE)
            scheduler.add(seq)  # its sampling record, as the engine queues it
            scheduler.waiting.clear()
            return seq
        seq = scheduled_like(new_seq, token_ids, block_table, is_prefill)
        seq.on_workers = not is_prefill
        ours.append(seq)
        nano = scheduled_like(NanoSequence, token_ids, block_table, is_prefill)
        nano.is_prefill = is_prefill  # its __getstate__ pickles the whole token list only while prefilling
        simple.append(nano)
    return Case(name, is_prefill, ours, simple, scheduler)


def make_cases(seed: int = 0) -> list[Case]:
    rng = random.Random(seed)
    cases = [make_case(f"decode {n}", [rng.randint(100, 2048) for _ in range(n)], False, rng)
             for n in (64, 256, 512)]
    cases.append(make_case("prefill 16384", [16_384], True, rng))
    return cases


def check_round_trip(case: Case) -> None:
    """Both designs deliver what a worker needs of every sequence (ours: with the tables it holds)."""
    ours = decode_control(case.encode_ours()).step
    _, simple, is_prefill = pickle.loads(case.encode_simple())
    assert is_prefill == case.is_prefill and bool(ours.prefill) == case.is_prefill
    tables = BlockTables()
    if not case.is_prefill:  # the running sequences' tables arrived when they were prefilled
        tables.tables = {seq.seq_id: list(seq.block_table) for seq in case.ours}
    tables.update(ours)
    assert len(simple) == len(case.ours)
    for i, (seq, nano) in enumerate(zip(case.ours, simple)):
        assert tables.tables[seq.seq_id] == nano.block_table == seq.block_table
        if case.is_prefill:
            assert ours.prefill[i].token_ids == nano.token_ids == seq.token_ids
        else:
            assert int_list(ours.decode_tokens)[i] == nano.last_token == seq.last_token
            assert int_list(ours.decode_context_lens)[i] == nano.num_tokens == seq.num_tokens


def decode_and_apply(data) -> None:
    """Ours on a worker: decode the message and apply its table changes."""
    READER_TABLES.update(decode_control(data).step)


READER_TABLES = BlockTables()  # a reader process's tables (the decode cases change none of them)


# --- in-process microbenchmarks ---------------------------------------------------------------

def per_call_us(fn, repeats: int) -> float:
    """Best of ``repeats`` short timeit runs (~2 ms each): the least-disturbed run, which on a
    shared, busy machine is the one that measures the code rather than its neighbours."""
    timer = timeit.Timer(fn)
    number = 1
    while timer.timeit(number) < 2e-3:
        number *= 2
    return min(timer.repeat(repeats, number)) / number * 1e6


def memcpy_us(payload: bytes, repeats: int) -> float:
    """The floor: one copy of the message's bytes into shared memory."""
    shm = SharedMemory(create=True, size=len(payload))
    try:
        buf = shm.buf
        end = len(payload)

        def copy_in():
            buf[:end] = payload
        result = per_call_us(copy_in, repeats)
        del buf
        return result
    finally:
        shm.close()
        shm.unlink()


@dataclass
class Codec:
    """One design's serialization: how rank 0 encodes a step and how a reader decodes it."""
    encode: Callable[[], bytes]
    decoder: str        # a key of DECODERS, so reader processes can look it up


DECODERS = {
    "msgspec": decode_and_apply,
    "pickle": pickle.loads,
    "none": len,        # the wake-up floor: nothing to decode
}


def microbench(codec: Codec, repeats: int) -> dict:
    payload = codec.encode()
    decode = DECODERS[codec.decoder]
    return {
        "bytes": len(payload),
        "encode": per_call_us(codec.encode, repeats),
        "decode": per_call_us(lambda: decode(payload), repeats),
        "memcpy": memcpy_us(payload, repeats),
    }


def worker_inputs_us(case: Case, repeats: int) -> tuple[float, float]:
    """A decode step's forward inputs built on a worker, ours and nano-vllm's (see main)."""
    builder = InputBuilder(BLOCK_SIZE, torch.device("cpu"))
    builder.block_tables.update(StepMessage(new_tables=[BlockTable(seq.seq_id, list(seq.block_table))
                                                        for seq in case.ours]))  # sent when they were prefilled
    message = decode_control(case.encode_ours()).step
    _, simple_seqs, _ = pickle.loads(case.encode_simple())
    return (per_call_us(lambda: builder.build(message), repeats),
            per_call_us(lambda: nano_prepare_decode(simple_seqs, BLOCK_SIZE), repeats))


# --- transports: rank 0's sending side, and what a reader process opens -----------------------

class RingChannel:
    """Ours: tpengine's shared-memory ring; readers spin, then poll with growing sleeps."""

    def __init__(self, num_readers: int, ctx) -> None:
        self.writer = ShmRingWriter(num_readers)

    def reader_handle(self, index: int) -> tuple:
        return ("ring", self.writer.name)

    def send(self, payload: bytes) -> None:
        self.writer.write(payload, timeout=TIMEOUT_S)

    def close(self) -> None:
        self.writer.close()


class EventChannel:
    """nano-vllm's: one length-prefixed SharedMemory buffer, one Event per reader."""

    def __init__(self, num_readers: int, ctx) -> None:
        self.shm = SharedMemory(create=True, size=SIMPLE_SHM_BYTES)
        self.events = [ctx.Event() for _ in range(num_readers)]

    def reader_handle(self, index: int) -> tuple:
        return ("event", self.shm.name, self.events[index])

    def send(self, payload: bytes) -> None:
        n = len(payload)
        self.shm.buf[0:4] = n.to_bytes(4, "little")
        self.shm.buf[4:n + 4] = payload
        for event in self.events:
            event.set()

    def close(self) -> None:
        self.shm.close()
        self.shm.unlink()


def ring_receiver(name: str, index: int, writer_pid: int):
    reader = ShmRingReader(name, index)

    def receive(decode) -> bool:
        data = reader.read()  # raises PeerDiedError if rank 0 dies
        if data == STOP:
            return False
        decode(data)
        return True
    return receive, reader.close


def event_receiver(name: str, event, index: int, writer_pid: int):
    shm = SharedMemory(name=name)

    def receive(decode) -> bool:
        while not event.wait(1.0):  # nano-vllm waits forever; a timeout lets an orphan exit
            os.kill(writer_pid, 0)  # raises once rank 0 is gone
        n = int.from_bytes(shm.buf[0:4], "little")
        with shm.buf[4:n + 4] as data:
            if n:
                decode(data)  # nano-vllm: pickle.loads(self.shm.buf[4:n+4])
        event.clear()
        return n != 0
    return receive, shm.close


class AckBoard:
    """The shared ack channel: reader r stores how many steps it has decoded in its own cache line."""
    LINE_WORDS = 8

    def __init__(self, num_readers: int, name: str | None = None) -> None:
        if name is None:
            self.shm = SharedMemory(create=True, size=num_readers * self.LINE_WORDS * 8)
        else:
            self.shm = SharedMemory(name=name)
        self.owner = name is None
        self.words = self.shm.buf.cast("Q")
        self.counts = slice(0, num_readers * self.LINE_WORDS, self.LINE_WORDS)

    @property
    def name(self) -> str:
        return self.shm.name

    def post(self, reader: int, steps_done: int) -> None:
        self.words[reader * self.LINE_WORDS] = steps_done

    def wait_all(self, steps_done: int, procs: list) -> None:
        words, counts = self.words, self.counts
        deadline = time.monotonic() + TIMEOUT_S
        polls = 0
        while min(words[counts]) < steps_done:
            os.sched_yield()
            polls += 1
            if polls % 4096 == 0:
                if any(p.exitcode is not None for p in procs):
                    raise RuntimeError(f"a reader exited: {[p.exitcode for p in procs]}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"readers stuck at {list(words[counts])}, want {steps_done}")

    def close(self) -> None:
        self.words.release()
        self.shm.close()
        if self.owner:
            self.shm.unlink()


def reader_main(handle: tuple, ack_name: str, num_readers: int, index: int, decoder: str,
                cpus: set[int], writer_pid: int) -> None:
    """A worker: receive, decode, acknowledge, until the empty message."""
    os.sched_setaffinity(0, cpus)  # always set: forkserver children inherit the server's mask
    kind, *args = handle
    opener = ring_receiver if kind == "ring" else event_receiver
    receive, close_receiver = opener(*args, index, writer_pid)
    acks = AckBoard(num_readers, ack_name)
    decode = DECODERS[decoder]
    try:
        steps_done = 0
        while receive(decode):
            steps_done += 1
            acks.post(index, steps_done)
    finally:
        acks.close()
        close_receiver()


# --- end to end -------------------------------------------------------------------------------

def stop_readers(channel, procs: list) -> None:
    try:
        channel.send(STOP)
    except Exception:  # a dead reader or a torn ring: terminate below
        pass
    for proc in procs:
        proc.join(5)
        if proc.is_alive():
            proc.terminate()
            proc.join()


def end_to_end_us(channel_cls, codec: Codec, num_readers: int, args) -> list[float]:
    """Per-step µs from rank 0 starting to encode until every reader has decoded and acked."""
    ctx = mp.get_context("forkserver")
    all_cpus = os.sched_getaffinity(0)
    cpu_list = sorted(all_cpus)
    pinned = args.pin and num_readers + 1 <= len(cpu_list)
    samples = []
    with ExitStack() as cleanup:  # unwinds in reverse: readers stopped, then segments unlinked
        channel = channel_cls(num_readers, ctx)
        cleanup.callback(channel.close)
        acks = AckBoard(num_readers)
        cleanup.callback(acks.close)
        procs = []
        cleanup.callback(stop_readers, channel, procs)
        for r in range(num_readers):
            cpus = {cpu_list[r + 1]} if pinned else all_cpus
            proc = ctx.Process(target=reader_main, daemon=True, args=(
                channel.reader_handle(r), acks.name, num_readers, r, codec.decoder, cpus,
                os.getpid()))
            proc.start()
            procs.append(proc)
        if pinned:
            os.sched_setaffinity(0, {cpu_list[0]})
            cleanup.callback(os.sched_setaffinity, 0, all_cpus)
        for step in range(1, args.warmup + args.steps + 1):
            start = time.perf_counter_ns()
            channel.send(codec.encode())
            acks.wait_all(step, procs)
            elapsed = time.perf_counter_ns() - start
            if step > args.warmup:
                samples.append(elapsed / 1e3)
            if args.gap_us:
                time.sleep(args.gap_us * 1e-6)
    return samples


def summarize(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


# --- report -----------------------------------------------------------------------------------

def pair(a: float, b: float, fmt: str = "{:.1f}") -> str:
    return f"{fmt.format(a)} / {fmt.format(b)}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=200, help="timeit runs per microbenchmark")
    parser.add_argument("--readers", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--gap-us", type=float, default=0.0,
                        help="rank 0 sleeps this long between steps (a stand-in forward pass)")
    parser.add_argument("--no-pin", dest="pin", action="store_false")
    args = parse_with_quick(parser, argv, dict(steps=20, warmup=5, repeats=3, readers=[1]))

    ncpu = len(os.sched_getaffinity(0))
    # a reader re-runs this script's imports as it starts (multiprocessing's __main__ fix-up): preloaded, they're free
    mp.get_context("forkserver").set_forkserver_preload(
        ["torch", "nano_baseline", "tpengine.distributed.messages", "tpengine.distributed.shm.ring",
         "tpengine.engine.scheduler", "tpengine.runner.block_tables", "tpengine.runner.inputs"])
    cases = make_cases()
    for case in cases:
        check_round_trip(case)

    print(f"# Control-plane cost per step ({ncpu} CPUs, {args.steps} steps after {args.warmup} "
          f"warm-up, gap {args.gap_us:g} µs)\n")
    print("In process, µs per call (best of short timeit runs). Pairs are ours (msgspec) / simple (pickle).\n")
    print("| case | bytes | encode µs | decode µs | enc+dec ratio | memcpy floor µs |")
    print("|---|---|---|---|---|---|")
    micro = {}
    for case in cases:
        ours = microbench(Codec(case.encode_ours, "msgspec"), args.repeats)
        simple = microbench(Codec(case.encode_simple, "pickle"), args.repeats)
        micro[case.name] = ours, simple
        ratio = (simple["encode"] + simple["decode"]) / (ours["encode"] + ours["decode"])
        print(f"| {case.name} | {ours['bytes']:,} / {simple['bytes']:,} "
              f"| {pair(ours['encode'], simple['encode'])} | {pair(ours['decode'], simple['decode'])} "
              f"| {ratio:.1f}x | {pair(ours['memcpy'], simple['memcpy'], '{:.2f}')} |", flush=True)

    print("\nOn a worker, after the message: a decode step's forward inputs (token, position, cache slot and context "
          "length per row, the padded block tables) as tensors, µs per call. Ours: runner/inputs.py's "
          "InputBuilder.build from the decoded message and the tables the worker keeps; simple: nano-vllm's "
          "prepare_decode from the unpickled sequences.\n")
    print("| case | ours µs | simple µs | ratio |")
    print("|---|---|---|---|")
    for case in cases:
        if not case.is_prefill:
            ours, simple = worker_inputs_us(case, args.repeats)
            print(f"| {case.name} | {ours:.1f} | {simple:.1f} | {simple / ours:.1f}x |", flush=True)

    print("\nEnd to end, µs per step: encode on rank 0 -> every reader decoded and acked "
          "(ack: per-reader counter in SharedMemory, polled by rank 0).\n")
    print("| case | readers | pinned | ours median / p90 | simple median / p90 | ratio (median) |")
    print("|---|---|---|---|---|---|")
    e2e = {}
    wakeup = Codec(lambda: b"\x00", "none")
    rows = [(case.name, Codec(case.encode_ours, "msgspec"),
             Codec(case.encode_simple, "pickle")) for case in cases]
    rows.append(("wake-up floor (1 B, no decode)", wakeup, wakeup))
    for num_readers in args.readers:
        pinned = "yes" if args.pin and num_readers + 1 <= ncpu else "no"
        for name, ours_codec, simple_codec in rows:
            ours = summarize(end_to_end_us(RingChannel, ours_codec, num_readers, args))
            simple = summarize(end_to_end_us(EventChannel, simple_codec, num_readers, args))
            e2e[name, num_readers] = ours, simple
            print(f"| {name} | {num_readers} | {pinned} | {pair(*ours)} | {pair(*simple)} "
                  f"| {simple[0] / ours[0]:.1f}x |", flush=True)
    if max(args.readers) + 1 > ncpu:
        print(f"\n{max(args.readers)} readers + rank 0 oversubscribe {ncpu} CPUs: those rows "
              "include time-slicing between processes, not only messaging.")

    target = "decode 256"
    ours, simple = micro[target]
    print(f"\n## {target}: ours vs simple (target >= 5x)\n")
    print(f"- encode+decode in process: {ours['encode'] + ours['decode']:.1f} µs vs "
          f"{simple['encode'] + simple['decode']:.1f} µs -> "
          f"{(simple['encode'] + simple['decode']) / (ours['encode'] + ours['decode']):.1f}x")
    for num_readers in args.readers:
        (o_med, _), (s_med, _) = e2e[target, num_readers]
        print(f"- end to end, {num_readers} reader(s): {o_med:.1f} µs vs {s_med:.1f} µs -> "
              f"{s_med / o_med:.1f}x")


if __name__ == "__main__":
    main()
