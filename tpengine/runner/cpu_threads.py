"""On the CPU, a step too small to share among threads runs on one. Every parallel region of a step wakes the
rank's other threads and waits for them at its end; with sleeping waits (OMP_WAIT_POLICY=PASSIVE, as a machine
shared with a server's HTTP side wants) a tiny model's batch-1 decode step took 1.8 ms on two threads against
0.6 ms on one (docs/benchmarks.md). Where the split pays depends on the model, the machine and the wait policy, so
warm-up measures it: each decode row bucket and a few prompt sizes, on one thread and on all, and the largest
sizes one thread ran faster become the limits. A rank with one thread, or a tensor- or pipeline-parallel rank
(its collectives tie its step time to the other ranks'), never changes its count.
"""
import struct
import time

import torch

from tpengine.distributed.messages import StepMessage

# decode rows of this many tokens of context each (or max_model_len's), when warm-up measures them; a decode step
# whose rows hold more in all than the limit's rows at this context runs on every thread (attention grows with it)
CALIBRATION_CONTEXT = 256
# prompt steps measured at warm-up (until all threads win by more than STREAMING_SLOWDOWN): past the largest that one
# thread won (or lost by less, with decode rows), every step runs on all threads
CALIBRATION_PROMPT_SIZES = (16, 32, 64, 128, 256, 384, 512)
# each size's time: the fastest of this many runs on each count (a machine's noise only slows a run)
CALIBRATION_RUNS = 3
# one thread must be this much faster to take a size: near the crossing either count does as well
ONE_THREAD_MARGIN = 0.9
# a prompt step that carries decode rows (requests are streaming) runs on one thread where one takes at most this
# much longer than all: with every core computing, the server's event loop (it needs a core and the GIL, which the
# engine thread takes back after each op) got neither for the step's length, and a first token already made waited
# 12-17 ms behind the next prompt's step (docs/benchmarks.md)
STREAMING_SLOWDOWN = 1.3


class StepThreads:
    """How many threads this rank's next step runs on: one for a decode step of at most max_one_thread_rows rows
    (and at most as much context as they would hold at CALIBRATION_CONTEXT), a prompt step of at most
    max_one_thread_tokens tokens, or one of at most max_streaming_tokens with decode rows (STREAMING_SLOWDOWN); every
    thread otherwise. The limits are 0 until calibrated."""

    def __init__(self, num_threads: int):
        self.num_threads = num_threads
        self.max_one_thread_rows = 0
        self.max_one_thread_tokens = 0
        self.max_streaming_tokens = 0
        self.calibration_context = CALIBRATION_CONTEXT  # the decode rows' context when they were measured
        self._current = num_threads

    def enter(self, step: StepMessage) -> None:
        """Set the thread count for step (before its inputs are built: they run on the same threads)."""
        if not (self.max_one_thread_rows or self.max_one_thread_tokens or self.max_streaming_tokens):
            return
        self._use(1 if self.fits_one_thread(step) else self.num_threads)

    def fits_one_thread(self, step: StepMessage) -> bool:
        num_rows = len(step.decode_seq_ids) // 8  # an int_column: 8 bytes a row
        if step.prefill:
            num_tokens = num_rows + sum(len(chunk.token_ids) for chunk in step.prefill)
            # decode rows: requests are streaming, and the step leaves a core to the HTTP side where it may
            return num_tokens <= max(self.max_one_thread_tokens, self.max_streaming_tokens if num_rows else 0)
        if num_rows > self.max_one_thread_rows:
            return False
        context = sum(struct.unpack(f"{num_rows}q", step.decode_context_lens))
        return context <= self.max_one_thread_rows * self.calibration_context

    def _use(self, num_threads: int) -> None:
        if num_threads != self._current:
            torch.set_num_threads(num_threads)
            self._current = num_threads

    def restore(self) -> None:
        """Every thread again (the rank's engine is closing: its process may go on without it)."""
        self._use(self.num_threads)

    def calibrate(self, run_decode, run_prompt, decode_sizes: list[int], context_len: int,
                  max_prompt_tokens: int) -> None:
        """Measure run_decode(rows) (rows of context_len tokens) for each decode size and run_prompt(tokens) for
        CALIBRATION_PROMPT_SIZES up to max_prompt_tokens, on one thread and on all, up to the first size all
        threads run faster (prompts: faster by more than STREAMING_SLOWDOWN); leaves every thread in use."""
        assert not (self.max_one_thread_rows or self.max_one_thread_tokens or self.max_streaming_tokens), \
            "enter() would pick the count"
        rows = self._largest_sizes(run_decode, decode_sizes, [ONE_THREAD_MARGIN])[0]
        tokens, streaming = self._largest_sizes(
            run_prompt, [size for size in CALIBRATION_PROMPT_SIZES if size <= max_prompt_tokens],
            [ONE_THREAD_MARGIN, STREAMING_SLOWDOWN])
        self.calibration_context, self.max_one_thread_rows = context_len, rows
        self.max_one_thread_tokens, self.max_streaming_tokens = tokens, streaming

    def _largest_sizes(self, run, sizes, ratios: list[float]) -> list[int]:
        """For each ratio, the largest of sizes up to which one thread takes at most ratio times all threads' time
        at every size; stops at the first size past every ratio (a larger step only has more work to share)."""
        largest, open_ratios = [0] * len(ratios), set(range(len(ratios)))
        for size in sizes:
            one, every = (self._fastest(run, size, count) for count in (1, self.num_threads))
            open_ratios -= {i for i in open_ratios if one > every * ratios[i]}
            if not open_ratios:
                break
            for i in open_ratios:
                largest[i] = size
        self._use(self.num_threads)
        return largest

    def _fastest(self, run, size: int, num_threads: int) -> float:
        self._use(num_threads)
        run(size)  # a first run pays what only a first run does: a replay's recording, oneDNN's kernels per count
        times = []
        for _ in range(CALIBRATION_RUNS):
            started = time.perf_counter()
            run(size)
            times.append(time.perf_counter() - started)
        return min(times)


def step_threads_for(device: torch.device, num_ranks: int, batch_invariant: bool) -> StepThreads | None:
    """A rank's StepThreads: a CPU engine of one rank with several threads, unless batch-invariant (the decode
    attention's split of a row's keys follows the thread count); None where the count never changes."""
    num_threads = torch.get_num_threads()
    if device.type != "cpu" or num_ranks > 1 or num_threads < 2 or batch_invariant:
        return None
    return StepThreads(num_threads)
