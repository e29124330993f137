"""tp>1: rank 0 plus N-1 worker processes, spawned here or started by torchrun, fed through the control plane.

Any worker failure becomes a WorkerFailedError on rank 0 naming the rank, and every rank is
stopped; the ring's segment is unlinked as soon as every worker has attached, so no way the
processes end can leave it behind. A watcher thread turns a dead rank inside an NCCL collective,
and a rank that does not answer within the step deadline, into that same error.
"""
import base64
import ctypes
import logging
import os
import platform
import signal
import subprocess
import sys
import threading
import time
import weakref
from contextlib import contextmanager
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist

from tpengine.config import EngineConfig
from tpengine.distributed.broadcast_channel import BroadcastChannel
from tpengine.distributed.messages import InitMessage, ShutdownMessage, StepEnvelope, decode_error, encode
from tpengine.distributed.parallel_state import (PipelineGroup, TensorParallelGroup, check_gpus_for,
                                                 local_device_index, new_process_group, pick_backend, resolve_device,
                                                 serve_store, torchrun_groups)
from tpengine.distributed.shm.ring import ShmRingWriter, stores_are_ordered
from tpengine.distributed.shm.segment import PeerDiedError
from tpengine.errors import WorkerFailedError
from tpengine.runner.executor import Executor
from tpengine.runner.sampler import SamplerOutput

logger = logging.getLogger("tpengine")

WORKER_START_TIMEOUT_S = 900.0  # start-up loads the checkpoint: minutes for a big one from a slow disk
WORKER_EXIT_TIMEOUT_S = 10.0
WATCH_INTERVAL_S = 0.1
REPORT_WAIT_S = 2.0  # after a failed collective, how long a dying worker gets to post its traceback

_executors: "weakref.WeakSet[MultiprocExecutor]" = weakref.WeakSet()


def _disown_in_forked_child() -> None:
    for executor in list(_executors):
        executor.disown()


os.register_at_fork(after_in_child=_disown_in_forked_child)


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "stopped responding"
    if exitcode < 0:
        return f"was killed by signal {signal.Signals(-exitcode).name}"
    return f"exited with code {exitcode}"


def _process_state(pid: int) -> str:
    """The kernel's one-letter state of pid ('T': stopped), '' if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return ""


def _reports_a_lost_peer(traceback: str) -> bool:
    """A report that only says another rank went away: the rank that went is the cause."""
    last = traceback.strip().splitlines()[-1] if traceback.strip() else ""
    return any(sign in last for sign in ("by peer", "PeerDiedError", "Broken pipe", "Connection reset"))


def _decode_report(data: bytes) -> str:
    try:
        return decode_error(data).traceback
    except msgspec.DecodeError:
        return f"(an error report of {len(data)} bytes that could not be decoded)"


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig):
        self.config = config
        self.world_size = config.world_size
        self.pipeline: PipelineGroup | None = None
        self.processes: list[subprocess.Popen] = []  # empty under torchrun: rank 0 does not own the others
        self.ring: ShmRingWriter | None = None
        self.channel = None
        self.group: TensorParallelGroup | None = None
        self.store = None
        self.closed = False
        self.owner_pid = os.getpid()
        self.num_threads = torch.get_num_threads()  # a CPU rank 0 shares the cores with its workers until shutdown
        self._busy: tuple[float, float, str] | None = None  # (since, limit, what) while rank 0 waits on the ranks
        self._verdict: WorkerFailedError | None = None  # the watcher's finding, set before it stops the ranks
        self._aborted = False
        self._native: list = []  # the store and groups this engine made: C++ objects a forked copy must not free
        _executors.add(self)
        try:
            if dist.is_initialized():
                self._join_torchrun_group()
            else:
                self._spawn_workers()
            threading.Thread(target=_watch, args=(weakref.ref(self),), name="tpengine-watcher", daemon=True).start()
            with self._deadline(WORKER_START_TIMEOUT_S, "start-up"):
                # rank 0's own shard; its setup collectives run in step with the workers'
                super().__init__(config, self.group, self.device, self.pipeline)
        except BaseException as e:
            self._stop_after(e)

    # --- start ----------------------------------------------------------------------------------

    def _spawn_workers(self) -> None:
        check_gpus_for(self.world_size, self.config.device)
        self.device = resolve_device(self.config.device, local_device_index(0, launched_by_torchrun=False))
        self.store = serve_store(timedelta(seconds=WORKER_START_TIMEOUT_S))
        if stores_are_ordered():
            self.ring = ShmRingWriter(self.world_size - 1)
        else:
            logger.warning("control plane: a gloo broadcast, not the shared-memory ring, which needs x86 store "
                           "ordering (this CPU is %s)", platform.machine())
        init = base64.b64encode(encode(InitMessage(self.config, self.ring and self.ring.name))).decode()
        # A fresh interpreter per worker (not multiprocessing): the user's __main__ is never re-run.
        # Its stdin is a pipe only this process holds: the worker exits when this process ends.
        for rank in range(1, self.world_size):
            command = [sys.executable, "-m", "tpengine.runner.worker", str(rank), str(self.world_size),
                       str(self.store.port), init]
            self.processes.append(subprocess.Popen(command, stdin=subprocess.PIPE))
        self._wait_for_workers_to_attach()
        if self.ring is not None:
            self.ring.unlink()  # every worker holds its mapping: nothing can leave the segment behind now
        config = self.config
        self.group = TensorParallelGroup.create(self.store, 0, config.tensor_parallel_size, self.device)
        self.pipeline = PipelineGroup.create(self.store, 0, config.tensor_parallel_size, config.pipeline_parallel_size,
                                             config.pipeline_layers(), self.device)
        self._native = [native for native in (self.store, self.group.process_group, self.pipeline.process_group)
                        if native is not None]
        if self.ring is None:
            control = new_process_group(dist.PrefixStore("control", self.store), 0, self.world_size, self.device,
                                        "gloo")
            self._native.append(control)
            self.channel = BroadcastChannel(control, src=0)
        else:
            self.channel = self.ring

    def _wait_for_workers_to_attach(self) -> None:
        keys = [f"attached/{rank}" for rank in range(1, self.world_size)]
        deadline = time.monotonic() + WORKER_START_TIMEOUT_S
        while not self.store.check(keys):
            self._raise_if_a_worker_died()
            if time.monotonic() > deadline:
                raise WorkerFailedError(f"workers did not start within {WORKER_START_TIMEOUT_S:.0f} s")
            time.sleep(0.05)

    def _join_torchrun_group(self) -> None:
        if dist.get_world_size() != self.world_size or dist.get_rank() != 0:
            raise ValueError(f"under torchrun, LLM(tensor_parallel_size={self.config.tensor_parallel_size}, "
                             f"pipeline_parallel_size={self.config.pipeline_parallel_size}) runs on rank 0 of a group "
                             f"of {self.world_size} ranks; this is rank {dist.get_rank()} of {dist.get_world_size()}")
        self.device = resolve_device(self.config.device, local_device_index(0, launched_by_torchrun=True))
        control = BroadcastChannel(dist.new_group(backend="gloo"))
        # One host (torchrun's local world is the whole world) with ordered stores: steps go through shared memory.
        one_host = os.environ.get("LOCAL_WORLD_SIZE") == str(self.world_size)
        if one_host and stores_are_ordered():
            self.ring = ShmRingWriter(self.world_size - 1)
        control.write(encode(InitMessage(self.config, self.ring and self.ring.name)))
        self.channel = self.ring or control
        logger.info("control plane to %d workers: %s", self.world_size - 1,
                    "shared-memory ring" if self.ring else
                    "gloo broadcast (ranks on several hosts)" if not one_host else
                    f"gloo broadcast (the ring needs x86 store ordering; this CPU is {platform.machine()})")
        if self.ring is not None:
            self.ring.wait_for_readers(timeout=WORKER_START_TIMEOUT_S)
            self.ring.unlink()
        self.group, self.pipeline = torchrun_groups(self.config.tensor_parallel_size, self.config.pipeline_layers(),
                                                    self.device)

    # --- steps ----------------------------------------------------------------------------------

    def send_to_workers(self, envelope: StepEnvelope) -> None:
        self.channel.write(encode(envelope))

    def submit(self, plan) -> None:
        self.check_open()
        try:
            with self._deadline(self.config.step_timeout_s, "one step" if self.config.pipeline_parallel_size == 1
                                else "one step's first stage"):
                super().submit(plan)
        except BaseException as e:
            self._stop_after(e)

    def collect(self, plan) -> SamplerOutput:
        self.check_open()
        try:
            with self._deadline(self.config.step_timeout_s, "one step's pipeline"):
                return super().collect(plan)
        except BaseException as e:
            self._stop_after(e)

    def abandon(self) -> None:
        """No one knows which of the steps in flight the ranks ran: every rank stops, as after a failed step."""
        super().abandon()
        self.shutdown(graceful=False)

    def check_open(self) -> None:
        if self.closed:
            raise RuntimeError("the engine is shut down (a worker failed, shutdown() was called, "
                               "or this is a forked copy of the process that owns it)")

    @contextmanager
    def _deadline(self, limit_s: float, what: str):
        """While inside, the watcher stops every rank if this takes longer than limit_s."""
        self._busy = (time.monotonic(), limit_s, what)
        try:
            yield
        finally:
            self._busy = None

    def check_health(self) -> None:
        if self.closed:
            raise RuntimeError("the engine is shut down (a worker failed, or shutdown() was called)")
        try:
            self._raise_if_a_worker_died()
        except WorkerFailedError as e:
            self._stop_after(e)

    # --- watching (from the watcher thread) -----------------------------------------------------

    def watch_once(self) -> None:
        busy = self._busy
        if busy is None or self._aborted:
            return
        since, limit_s, what = busy
        if any(p.poll() is not None for p in self.processes):
            # NCCL does not fail a collective whose peer died (gloo does): make the blocked call return
            if self._uses_nccl():
                self._abort_group()
            return
        if time.monotonic() - since > limit_s:
            ranks = self._silent_ranks()
            self._verdict = WorkerFailedError(
                f"{self._worker_kind} rank{'s' if len(ranks) > 1 else ''} {', '.join(map(self._name, ranks))} "
                f"did not answer within step_timeout_s={limit_s:g} s ({what}); every rank was stopped")
            for process in self.processes:
                process.kill()  # gloo then fails rank 0's collective at once
            if self._uses_nccl():
                self._abort_group()  # NCCL would not: unblock rank 0's collective

    def _silent_ranks(self) -> list[int]:
        """Ranks that hold the others up: stopped ones, else ones that never took the step, else all."""
        stopped = [rank for rank, p in enumerate(self.processes, 1) if _process_state(p.pid) in ("T", "t")]
        if stopped:
            return stopped
        if self.ring is not None and (lagging := [reader + 1 for reader in self.ring.lagging_readers()]):
            return lagging
        return list(range(1, self.world_size))

    @property
    def _worker_kind(self) -> str:
        return "tensor-parallel worker" if self.config.pipeline_parallel_size == 1 else "worker"

    def _name(self, rank: int) -> str:
        """A rank as its errors name it: with a pipeline, its stage and its place in the stage too."""
        if self.config.pipeline_parallel_size == 1:
            return str(rank)
        tp = self.config.tensor_parallel_size
        return f"{rank} (pipeline-parallel rank {rank // tp}, tensor-parallel rank {rank % tp})"

    def _uses_nccl(self) -> bool:
        # gloo fails a collective whose peer died, and its abort() does not unblock one; NCCL needs the abort
        return self.group is not None and pick_backend(self.device) == "nccl"

    def _abort_group(self) -> None:
        self._aborted = True
        try:
            self.group.abort()
            if self.pipeline is not None:
                self.pipeline.abort()
        except Exception:
            logger.exception("aborting the tensor-parallel group failed")

    # --- failure --------------------------------------------------------------------------------

    def _stop_after(self, error: BaseException):
        """Stop every rank first, then re-raise error, as a WorkerFailedError naming the rank if a worker caused it."""
        evidence = None
        try:
            evidence = self._collect_evidence(error)
        finally:
            self.shutdown(graceful=False)
        failure = self._verdict or self._failure(error, evidence)
        if failure is not None:
            raise failure from error
        raise error

    def _raise_if_a_worker_died(self) -> None:
        if any(p.poll() is not None for p in self.processes):
            evidence = self._collect_evidence(None)
            raise self._failure(None, evidence) or WorkerFailedError(f"a {self._worker_kind} exited during start-up")

    def _collect_evidence(self, error: BaseException | None) -> tuple[dict[int, int], dict[int, bytes]] | None:
        """Exit codes of dead workers and their raw error reports; nothing decoded, nothing that raises."""
        if isinstance(error, (KeyboardInterrupt, ValueError, WorkerFailedError)) or self._verdict is not None:
            return None
        # A collective that failed on rank 0 may be a worker dying right now: give it a moment
        # to post its traceback or be reaped.
        deadline = time.monotonic() + (REPORT_WAIT_S if error is not None else 0.0)
        while True:
            dead = {rank: p.poll() for rank, p in enumerate(self.processes, 1) if p.poll() is not None}
            reports = self.ring.reader_errors() if self.ring is not None else {}  # a worker posts before it exits
            if reports or dead or time.monotonic() >= deadline:
                return dead, {reader + 1: data for reader, data in reports.items()}
            time.sleep(0.05)

    def _failure(self, error: BaseException | None, evidence) -> WorkerFailedError | None:
        """A WorkerFailedError naming the failed rank, or None if error was not a worker's fault."""
        if evidence is None:
            return None
        dead, raw_reports = evidence
        reports = {rank: _decode_report(data) for rank, data in raw_reports.items()}
        # a rank that died without a word outranks the peers reporting their broken connection to it
        silent_deaths = [rank for rank in sorted(dead) if rank not in reports]
        if silent_deaths:
            rank = silent_deaths[0]
            return WorkerFailedError(f"{self._worker_kind} rank {self._name(rank)} {_describe_exit(dead[rank])}")
        if reports:
            causes = [rank for rank in sorted(reports) if not _reports_a_lost_peer(reports[rank])] or sorted(reports)
            rank = causes[0]
            return WorkerFailedError(f"{self._worker_kind} rank {self._name(rank)} raised an exception:\n"
                                     f"{reports[rank]}")
        if isinstance(error, PeerDiedError) or "by peer" in str(error):
            return WorkerFailedError(f"a {self._worker_kind} is gone: {error}")
        return None

    # --- stop -----------------------------------------------------------------------------------

    def shutdown(self, graceful: bool = True) -> None:
        """Stop every rank. Graceful between steps; after a failure or an interrupt mid-step the
        workers may sit in a collective that will never complete, so they are killed at once."""
        if self.closed:
            return
        self.closed = True
        workers_alive = all(p.poll() is None for p in self.processes)
        graceful = graceful and workers_alive and not self._aborted
        if self.channel is not None and graceful:
            try:
                self.channel.write(encode(ShutdownMessage()), **({"timeout": 2.0} if self.ring else {}))
            except Exception:
                graceful = False  # a worker already gone: it is killed below
        runner = getattr(self, "runner", None)
        if runner is not None and graceful:
            runner.close()  # CUDA graphs hold collectives: released before the group goes
        for process in self.processes:
            try:
                process.wait(timeout=WORKER_EXIT_TIMEOUT_S if graceful else 0)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            if process.stdin is not None:
                process.stdin.close()
        if self.ring is not None:
            self.ring.close()
        if self.processes and self.group is not None:  # under torchrun the launch script owns the group
            if graceful:
                self.group.shutdown()
                if self.pipeline is not None:
                    self.pipeline.shutdown()
            elif self._uses_nccl() and not self._aborted:
                self._abort_group()
        self.group = self.store = self.pipeline = None
        torch.set_num_threads(self.num_threads)

    def disown(self) -> None:
        """In a forked child: this engine is the parent's. Never use or tear it down from here, and
        let go of the pipes that keep its workers alive."""
        self.closed = True
        for process in self.processes:
            if process.stdin is not None:
                process.stdin.close()
        # A forked copy of a gloo group or store must never be destroyed: its destructor waits on a
        # lock held by a thread that was not forked. Leak this copy's references instead.
        for native in self._native:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(native))


def _watch(executor_ref: "weakref.ref[MultiprocExecutor]") -> None:
    """The watcher thread: holds no strong reference, so a dropped engine is still collected."""
    while True:
        time.sleep(WATCH_INTERVAL_S)
        executor = executor_ref()
        if executor is None or executor.closed:
            return
        try:
            executor.watch_once()
        except Exception:
            logger.exception("the tensor-parallel watcher failed")
        del executor
