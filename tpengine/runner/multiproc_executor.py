"""tp>1: rank 0 plus N-1 worker processes, spawned here or started by torchrun, fed through the control plane.

Any worker failure becomes a WorkerFailedError on rank 0 naming the rank, and every rank is
stopped; the ring's segment is unlinked whatever way the engine ends.
"""
import base64
import logging
import os
import signal
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from tpengine.config import EngineConfig
from tpengine.distributed.broadcast_channel import BroadcastChannel
from tpengine.distributed.messages import (InitMessage, ShutdownMessage, StepMessage, decode_error, encode)
from tpengine.distributed.parallel_state import find_free_port, pick_backend
from tpengine.distributed.shm_ring import PeerDiedError, ShmRingWriter
from tpengine.runner.executor import Executor
from tpengine.runner.model_runner import resolve_device

logger = logging.getLogger("tpengine")

WORKER_START_TIMEOUT_S = 300.0
WORKER_EXIT_TIMEOUT_S = 10.0


class WorkerFailedError(RuntimeError):
    """A tensor-parallel worker died or raised; the engine is shut down."""


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "stopped responding"
    if exitcode < 0:
        return f"was killed by signal {signal.Signals(-exitcode).name}"
    return f"exited with code {exitcode}"


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig):
        self.config = config
        self.world_size = config.tensor_parallel_size
        self.processes: list[subprocess.Popen] = []  # empty under torchrun: rank 0 does not own the others
        self.ring: ShmRingWriter | None = None
        self.channel = None
        self.closed = False
        self.num_threads = torch.get_num_threads()  # a CPU rank 0 shares the cores with its workers until shutdown
        try:
            if dist.is_initialized():
                self._join_torchrun_group()
            else:
                self._spawn_workers()
            super().__init__(config)  # rank 0's own shard; its setup collectives run in step with the workers'
        except BaseException as e:
            self._stop_after(e)

    # --- start ----------------------------------------------------------------------------------

    def _spawn_workers(self) -> None:
        self.ring = self.channel = ShmRingWriter(self.world_size - 1)
        init_method = f"tcp://127.0.0.1:{find_free_port()}"
        init = base64.b64encode(encode(InitMessage(self.config, self.ring.name))).decode()
        # A fresh interpreter per worker (not multiprocessing): the user's __main__ is never re-run.
        for rank in range(1, self.world_size):
            command = [sys.executable, "-m", "tpengine.runner.worker", str(rank), str(self.world_size), init_method, init]
            self.processes.append(subprocess.Popen(command, stdin=subprocess.DEVNULL))
        self._wait_for_workers_to_attach()
        backend = pick_backend(resolve_device(self.config.device, 0))
        dist.init_process_group(backend, init_method=init_method, rank=0, world_size=self.world_size)

    def _wait_for_workers_to_attach(self) -> None:
        deadline = time.monotonic() + WORKER_START_TIMEOUT_S
        while True:
            try:
                self.ring.wait_for_readers(timeout=0.1)
                return
            except TimeoutError:
                self._raise_if_a_worker_died()
                if time.monotonic() > deadline:
                    raise WorkerFailedError(f"workers did not start within {WORKER_START_TIMEOUT_S:.0f} s")

    def _join_torchrun_group(self) -> None:
        if dist.get_world_size() != self.world_size or dist.get_rank() != 0:
            raise ValueError(f"under torchrun, LLM(tensor_parallel_size={self.world_size}) runs on rank 0 of a "
                             f"group of that size; this is rank {dist.get_rank()} of {dist.get_world_size()}")
        control = BroadcastChannel(dist.new_group(backend="gloo"))
        # One host (torchrun's local world is the whole world): steps go through shared memory.
        one_host = os.environ.get("LOCAL_WORLD_SIZE") == str(self.world_size)
        if one_host:
            self.ring = ShmRingWriter(self.world_size - 1)
        control.write(encode(InitMessage(self.config, self.ring.name if one_host else None)))
        self.channel = self.ring or control
        logger.info("control plane to %d workers: %s", self.world_size - 1,
                    "shared-memory ring" if one_host else "gloo broadcast (ranks on several hosts)")
        if self.ring is not None:
            self.ring.wait_for_readers(timeout=WORKER_START_TIMEOUT_S)

    # --- steps ----------------------------------------------------------------------------------

    def send_to_workers(self, step: StepMessage) -> None:
        self.channel.write(encode(step))

    def execute(self, seqs, is_prefill: bool) -> list[int]:
        if self.closed:
            raise RuntimeError("the engine is shut down (a worker failed, or shutdown() was called)")
        try:
            return super().execute(seqs, is_prefill)
        except BaseException as e:
            self._stop_after(e)

    # --- failure --------------------------------------------------------------------------------

    def _stop_after(self, error: BaseException):
        """Stop every rank, then re-raise error, as a WorkerFailedError naming the rank if a worker caused it."""
        failure = self._failure(error)
        self.shutdown(graceful=False)
        if failure is not None:
            raise failure from error
        raise error

    def _raise_if_a_worker_died(self) -> None:
        if any(p.poll() is not None for p in self.processes):
            raise self._failure(None) or WorkerFailedError("a tensor-parallel worker exited during start-up")

    def _failure(self, error: BaseException | None) -> WorkerFailedError | None:
        """A WorkerFailedError naming the failed rank, or None if error was not a worker's fault."""
        if isinstance(error, (KeyboardInterrupt, ValueError, WorkerFailedError)):
            return None
        # A collective that failed on rank 0 may be a worker dying right now: give it a moment
        # to post its traceback or be reaped.
        deadline = time.monotonic() + (2.0 if error is not None else 0.0)
        while True:
            dead = [(rank, p.poll()) for rank, p in enumerate(self.processes, start=1) if p.poll() is not None]
            reports = self._error_reports()  # read after the exit codes: a worker posts before it exits
            if reports or dead or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if reports:
            rank = min(reports)
            return WorkerFailedError(f"tensor-parallel worker rank {rank} raised an exception:\n{reports[rank]}")
        if dead:
            rank, exitcode = dead[0]
            return WorkerFailedError(f"tensor-parallel worker rank {rank} {_describe_exit(exitcode)}")
        if isinstance(error, PeerDiedError) or "by peer" in str(error):
            return WorkerFailedError(f"a tensor-parallel worker is gone: {error}")
        return None

    def _error_reports(self) -> dict[int, str]:
        if self.ring is None:
            return {}
        return {index + 1: decode_error(data).traceback for index, data in self.ring.reader_errors().items()}

    # --- stop -----------------------------------------------------------------------------------

    def shutdown(self, graceful: bool = True) -> None:
        """Stop every rank. Graceful between steps; after a failure or an interrupt mid-step the
        workers may sit in a collective that will never complete, so they are killed at once."""
        if self.closed:
            return
        self.closed = True
        workers_alive = all(p.poll() is None for p in self.processes)
        graceful = graceful and workers_alive
        if self.channel is not None and graceful:
            try:
                self.channel.write(encode(ShutdownMessage()), **({"timeout": 2.0} if self.ring else {}))
            except Exception:
                pass  # a worker already gone: it is killed below
        for process in self.processes:
            try:
                process.wait(timeout=WORKER_EXIT_TIMEOUT_S if graceful else 0)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self.ring is not None:
            self.ring.close()
        torch.set_num_threads(self.num_threads)
        if dist.is_initialized() and self.processes:  # under torchrun the launch script owns the group
            try:
                dist.destroy_process_group()
            except Exception:
                pass
