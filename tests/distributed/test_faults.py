"""Failures end cleanly: a clear error on rank 0 within seconds, no process and no /dev/shm segment left."""
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import TP_MODEL, random_prompts
from tpengine import LLM, SamplingParams
from tpengine.runner.multiproc_executor import WorkerFailedError

LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)


def _segments() -> set[str]:
    """This process's segments (a ring's name starts with its creator's pid): other test runs may share the host."""
    return {name for name in os.listdir("/dev/shm") if name.startswith(f"tpengine_{os.getpid()}_")}


def _start_decoding(llm, num_prompts=3):
    for prompt in random_prompts(0, [20] * num_prompts, TP_MODEL["vocab_size"]):
        llm.add_request(prompt, LONG)
    for _ in range(3):
        llm.step()


def _step_until_error(llm, limit_s=20.0):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        llm.step()
    pytest.fail(f"no error within {limit_s} s")


def test_killed_worker_becomes_an_error_naming_its_rank_within_seconds(tiny_model):
    segments_before = _segments()
    llm = LLM(tiny_model, tensor_parallel_size=2, kvcache_block_size=16)
    segment = llm.executor.ring.name
    worker = llm.executor.processes[0]
    try:
        _start_decoding(llm)
        worker.kill()
        killed_at = time.monotonic()
        with pytest.raises(WorkerFailedError, match="worker rank 1 was killed by signal SIGKILL"):
            _step_until_error(llm)
    finally:
        llm.shutdown()  # a no-op after the failure shut it down; stops it if the test failed first
    assert time.monotonic() - killed_at < 10
    assert worker.poll() is not None
    assert segment not in _segments() and _segments() <= segments_before
    with pytest.raises(RuntimeError, match="shut down"):
        llm.step()


def test_exception_in_a_worker_comes_back_with_its_traceback(tiny_model):
    segments_before = _segments()
    llm = LLM(tiny_model, tensor_parallel_size=2, kvcache_block_size=16)
    segment = llm.executor.ring.name
    try:
        # Only the worker gets a message that is not a declared struct: it raises, rank 0 does not.
        llm.executor.channel.write(b"not a control message")
        llm.add_request([1, 2, 3], LONG)
        with pytest.raises(WorkerFailedError,
                           match=r"(?s)worker rank 1 raised an exception:.*Traceback.*msgspec.ValidationError"):
            _step_until_error(llm)
    finally:
        llm.shutdown()
    assert all(p.poll() is not None for p in llm.executor.processes)
    assert segment not in _segments() and _segments() <= segments_before


RANK0_SCRIPT = """
import sys
from tpengine import LLM, SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2, kvcache_block_size=16)
print(llm.executor.ring.name, *[p.pid for p in llm.executor.processes], flush=True)
llm.generate([[1, 2, 3]] * 4, SamplingParams(temperature=0, max_tokens=100000 // 64, ignore_eos=True),
             use_tqdm=False)
"""


def _start_rank0(tiny_model):
    process = subprocess.Popen([sys.executable, "-c", RANK0_SCRIPT, tiny_model], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    segment, *worker_pids = process.stdout.readline().split()
    assert segment.startswith("tpengine_"), process.stderr.read()[-3000:]
    time.sleep(0.5)  # let it decode
    return process, segment, [int(pid) for pid in worker_pids]


def _wait_gone(pids, segment, limit_s=10.0):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if os.path.exists(f"/proc/{pid}") and not _is_zombie(pid)]
        if not alive and segment not in _segments():
            return
        time.sleep(0.1)
    for pid in alive:  # fail, but leave no stray worker behind for the next tests
        os.kill(pid, signal.SIGKILL)
    pytest.fail(f"left behind: processes {alive}, segment present: {segment in _segments()}")


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_killed_rank0_takes_its_workers_and_segment_with_it(tiny_model):
    process, segment, worker_pids = _start_rank0(tiny_model)
    process.kill()
    process.wait()
    _wait_gone(worker_pids, segment)


def test_ctrl_c_stops_every_rank_and_leaves_nothing(tiny_model):
    process, segment, worker_pids = _start_rank0(tiny_model)
    os.killpg(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
    try:
        process.wait(timeout=15)
    finally:
        process.kill()
    assert "KeyboardInterrupt" in process.stderr.read()
    _wait_gone(worker_pids, segment)
