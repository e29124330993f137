"""One thread owns the engine; the event loop talks to it through a queue and gets outputs back.

Commands (add, abort, stop; add or remove a LoRA adapter) cross to the engine thread through a
thread-safe queue that the thread drains before every step, and blocks on while idle (an idle
server sleeps). Each step's reports go to the loop in one call, unbuilt: the loop builds the
outputs (a stream's text, its RequestOutput) while the engine thread runs the next step, and
hands each to the HTTP request it belongs to, which keeps only the newest output of each prompt
(or joins delta outputs): a client that reads slowly holds one output per prompt, never one per
step. A step runs off the event loop, so the server answers during a long prefill.
"""
import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator

from tpengine.engine.llm_engine import LLMEngine
from tpengine.engine.request import StepReports
from tpengine.entrypoints.metrics import Metrics, RequestTimes
from tpengine.errors import InvalidRequestError
from tpengine.lora.request import LoRARequest
from tpengine.outputs import RequestOutput, merge_deltas
from tpengine.sampling_params import PoolingParams, RequestOutputKind, SamplingParams

logger = logging.getLogger("tpengine")

# An idle engine thread wakes this often to notice a worker that died between requests.
IDLE_HEALTH_CHECK_S = 1.0


class EngineDeadError(RuntimeError):
    """The engine failed or was shut down: no request can run."""


class Submission:
    """One HTTP request's prompts in the engine; iterate it for {prompt index: latest output}."""

    def __init__(self, engine: "AsyncEngine", key: int, num_prompts: int, delta: bool = False, by_step: bool = False):
        self._engine = engine
        self.key = key
        self.num_unfinished = num_prompts
        self.delta = delta  # its outputs hold only what is new: ones not yet taken are joined, not replaced
        # deltas taken one engine step at a time, never joined (a consumer that stops at a token count: a thinking
        # budget); each step's outputs wait in order
        self.by_step = by_step
        self._steps: list[dict[int, RequestOutput]] = []
        self.request_ids: list[int] = []  # the engine's ids of its prompts (set and read on the engine thread)
        self.aborted = False
        self._latest: dict[int, RequestOutput] = {}  # prompt index -> its newest output not yet taken
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0

    def deliver(self, index: int, output: RequestOutput) -> None:
        """(event loop) A newer output of prompt `index`: cumulative, it holds everything an untaken older one
        did; a delta is joined to it."""
        if self.by_step:
            if not self._steps or index in self._steps[-1]:
                self._steps.append({})
            self._steps[-1][index] = output
        else:
            older = self._latest.get(index)
            self._latest[index] = output if older is None or not self.delta else merge_deltas(older, output)
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        """(event loop) The engine failed or stopped: the consumer raises error."""
        self._error = error
        self._ready.set()

    async def __aiter__(self) -> AsyncIterator[dict[int, RequestOutput]]:
        while self.num_unfinished:
            await self._ready.wait()
            self._ready.clear()
            if self._error is not None:
                raise self._error
            if self.by_step:
                latest = self._steps.pop(0) if self._steps else {}
                if self._steps:
                    self._ready.set()  # more steps wait
            else:
                latest, self._latest = self._latest, {}
            self.num_unfinished -= sum(output.finished for output in latest.values())
            yield latest

    def abort(self) -> None:
        """Abort whatever of it still runs (a client went away); a no-op once finished."""
        if not self.finished:
            self.num_unfinished = 0
            self.aborted = True
            self._engine.abort(self)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: Metrics | None = None):
        self.engine = engine
        self.metrics = metrics
        self.error: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._keys = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="tpengine-engine", daemon=True)
        # event loop only: request id -> (submission, prompt index, times), from its acceptance to its last output
        self._requests: dict[int, tuple[Submission, int, RequestTimes]] = {}

    # --- event-loop side ------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    @property
    def is_healthy(self) -> bool:
        return self.error is None and self._thread.is_alive()

    async def submit(self, prompts: list[list[int]], params: SamplingParams | PoolingParams, stream: bool,
                     lora_request: LoRARequest | None = None, by_step: bool = False) -> Submission:
        """Queue the prompts (all or none), on lora_request's adapter if one is given; PoolingParams embeds them
        (each one final output, an EmbeddingRequestOutput). Raises ValueError for a
        request the engine rejects (an adapter it cannot run among them),
        EngineDeadError when the engine is down. A streamed submission gets every step's outputs,
        another only the final ones (the engine then does no per-step work for it); by_step: a streamed one's
        steps come one at a time (Submission)."""
        if not self.is_healthy:
            raise EngineDeadError(f"the engine is not running: {self.error}")
        delta = isinstance(params, SamplingParams) and params.output_kind == RequestOutputKind.DELTA
        submission = Submission(self, next(self._keys), len(prompts), delta=delta, by_step=by_step)
        accepted = self._loop.create_future()
        self._commands.put(("add", submission, prompts, params, stream, accepted, time.monotonic(), lora_request))
        try:
            await accepted
        except asyncio.CancelledError:
            submission.abort()  # the add may still happen: the abort follows it in the queue
            raise
        return submission

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Check an adapter on the engine thread: ValueError if it cannot run on this model."""
        await self._lora_command("add_lora", lora_request)

    async def remove_lora(self, lora_int_id: int) -> None:
        """Forget an adapter: its slot frees once the requests running on it finish."""
        await self._lora_command("remove_lora", lora_int_id)

    async def _lora_command(self, method: str, argument) -> None:
        if not self.is_healthy:
            raise EngineDeadError(f"the engine is not running: {self.error}")
        done = self._loop.create_future()
        self._commands.put(("lora", method, argument, done))  # the engine is the engine thread's alone
        await done

    def abort(self, submission: Submission) -> None:
        """Abort a submission's requests (thread-safe; the engine thread does it before its next step)."""
        self._commands.put(("abort", submission))

    def abort_all(self) -> None:
        """Abort every request now: each ends with finish_reason "abort" (the end of a graceful shutdown)."""
        self._commands.put(("abort_all",))

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything, end the engine thread, and shut the engine down (workers, shared memory)."""
        if self.error is None:
            self.error = EngineDeadError("the server is shutting down")
        if self._thread.is_alive():
            self._commands.put(("stop",))
            self._thread.join(timeout)
        self.engine.shutdown()

    def _accepted(self, submission: Submission, stream: bool, arrival: float, accepted: asyncio.Future) -> None:
        # before any report of its requests: the engine thread queues this first
        for index, request_id in enumerate(submission.request_ids):
            self._requests[request_id] = (submission, index, RequestTimes(arrival, stream))
        _resolve(accepted, None)

    def _deliver(self, reports: StepReports) -> None:
        """A step's reports: build their outputs (in step order: the loop runs these calls as queued) and hand
        each to its submission; an aborted one's only count in the metrics."""
        try:
            outputs = reports.build()
        except BaseException as e:  # a bug: every request learns it, /health turns 503
            logger.exception("building outputs failed: %s", e)
            self.error = e
            self._commands.put(("stop",))
            self._fail_all(EngineDeadError(f"the engine failed: {e}"))
            return
        requests, metrics = self._requests, self.metrics
        now = time.monotonic()
        for output in outputs:
            entry = requests.get(output.request_id)
            if entry is None:
                continue  # its add failed part-way: nobody waits for it
            submission, index, times = entry
            if output.finished:
                del requests[output.request_id]
            if submission.aborted:
                if metrics is not None and output.finished:
                    metrics.record_finished(output)
                continue
            if metrics is not None:
                metrics.record_output(output, times, now)
            submission.deliver(index, output)

    def _fail_all(self, error: BaseException) -> None:
        """(event loop) Every request still running learns error."""
        submissions = {submission for submission, _, _ in self._requests.values()}
        self._requests.clear()
        for submission in submissions:
            submission.fail(error)

    # --- engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                commands = [] if engine.has_unfinished_requests() else [self._wait_for_command()]
                while True:
                    try:
                        commands.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                stopping = False
                for command in commands:
                    if stopping or command[0] == "stop":
                        stopping = True
                        self._reject(command)
                    elif command[0] == "add":
                        self._add(*command[1:])
                    elif command[0] == "lora":
                        self._lora(*command[1:])
                    elif command[0] == "abort":
                        for request_id in command[1].request_ids:
                            engine.abort(request_id, build=False)
                    else:
                        for request_id in engine.live_request_ids():
                            engine.abort(request_id, build=False)
                if stopping:
                    self._loop.call_soon_threadsafe(self._fail_all, EngineDeadError("the server is shutting down"))
                    self._reject_queued()
                    return
                if engine.has_unfinished_requests():
                    reports = engine.step_reports()
                    if reports:
                        self._loop.call_soon_threadsafe(self._deliver, reports)
                if self.metrics is not None:
                    self.metrics.record_engine_state(engine)
        except BaseException as e:  # a worker died, or a bug: every request learns it, /health turns 503
            logger.exception("engine failed: %s", e)
            self.error = e
            self._loop.call_soon_threadsafe(self._fail_all, EngineDeadError(f"the engine failed: {e}"))
            self._reject_until_stopped()

    def _wait_for_command(self):
        while True:
            try:
                return self._commands.get(timeout=IDLE_HEALTH_CHECK_S)
            except queue.Empty:
                self.engine.check_health()

    def _add(self, submission: Submission, prompts, params, stream: bool, accepted: asyncio.Future,
             arrival: float, lora_request: LoRARequest | None) -> None:
        request_ids = []
        try:
            for prompt in prompts:
                request_ids.append(self.engine.add_request(prompt, params, stream=stream, wait_for_grammar=False,
                                                           lora_request=lora_request))
        except ValueError as e:
            for request_id in request_ids:  # its final output reaches the loop, which knows no such request
                self.engine.abort(request_id, build=False)
            if len(prompts) > 1:
                e = InvalidRequestError(f"prompt {len(request_ids)}: {e}", getattr(e, "param", None))
            self._loop.call_soon_threadsafe(_resolve, accepted, e)
            return
        submission.request_ids = request_ids
        self._loop.call_soon_threadsafe(self._accepted, submission, stream, arrival, accepted)

    def _lora(self, method: str, argument, done: asyncio.Future) -> None:
        try:
            getattr(self.engine, method)(argument)
        except ValueError as e:
            self._loop.call_soon_threadsafe(_resolve, done, e)
            return
        self._loop.call_soon_threadsafe(_resolve, done, None)

    def _reject_until_stopped(self) -> None:
        while (command := self._commands.get())[0] != "stop":
            self._reject(command)
        self._reject_queued()

    def _reject_queued(self) -> None:
        while True:
            try:
                self._reject(self._commands.get_nowait())
            except queue.Empty:
                return

    def _reject(self, command) -> None:
        waiting = {"add": 5, "lora": 3}.get(command[0])  # where its future is: nothing will run it
        if waiting is not None:
            self._loop.call_soon_threadsafe(_resolve, command[waiting], EngineDeadError("the engine is not running"))


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():  # the waiting request was cancelled
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
