"""Failures end cleanly: a clear error on rank 0 within seconds, no process and no /dev/shm segment left."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.conftest import TP_MODEL, random_prompts
from tests.leftovers import assert_nothing_left, is_gone, snapshot
from tests.leftovers import segments as _segments
from tpengine import LLM, SamplingParams, WorkerFailedError

LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)


@pytest.fixture
def worker_fault(tmp_path, monkeypatch):
    """Workers started from now on first run `code` (a sitecustomize module on their PYTHONPATH);
    this process, already running, does not."""
    def install(code: str) -> None:
        (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(code))
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    return install


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


def _like_a_terminal_job():
    """Ctrl-C's default action in the child: a job started in the background by a shell without job control
    (as CI may run the suite) inherits SIGINT ignored, and Python keeps an ignored SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start_rank0(tiny_model):
    process = subprocess.Popen([sys.executable, "-c", RANK0_SCRIPT, tiny_model], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True,
                               preexec_fn=_like_a_terminal_job)
    segment, *worker_pids = process.stdout.readline().split()
    assert segment.startswith("tpengine_"), process.stderr.read()[-3000:]
    time.sleep(0.5)  # let it decode
    return process, segment, [int(pid) for pid in worker_pids]


def _wait_gone(pids, segment, limit_s=10.0):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if not is_gone(pid)]
        if not alive and not os.path.exists(f"/dev/shm/{segment}"):
            return
        time.sleep(0.1)
    for pid in alive:  # fail, but leave no stray worker behind for the next tests
        os.kill(pid, signal.SIGKILL)
    pytest.fail(f"left behind: processes {alive}, segment present: {os.path.exists(f'/dev/shm/{segment}')}")


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


DEEP_TRACEBACK_WORKER = """
import tpengine.runner.model_runner as model_runner

def _down(depth):
    if depth == 0:
        raise ValueError("the cause: this step cannot run")
    return _again(depth - 1)

def _again(depth):  # two functions: Python folds a repeated identical frame into one line
    return _down(depth)

def execute(self, step):
    _down(350)  # 700 frames, over 100 KB of traceback

model_runner.ModelRunner.execute = execute
"""


def test_a_100_kb_worker_traceback_comes_back_cut_in_the_middle_with_its_cause(tiny_model, worker_fault):
    worker_fault(DEEP_TRACEBACK_WORKER)
    before = snapshot()
    llm = LLM(tiny_model, tensor_parallel_size=2, kvcache_block_size=16)
    try:
        llm.add_request([1, 2, 3], LONG)
        with pytest.raises(WorkerFailedError) as failure:
            _step_until_error(llm)
    finally:
        llm.shutdown()
    message = str(failure.value)
    assert message.startswith("tensor-parallel worker rank 1 raised an exception:\nTraceback")
    assert "bytes cut]..." in message
    assert message.rstrip().endswith("ValueError: the cause: this step cannot run")
    assert_nothing_left(before)


def test_a_stopped_worker_fails_the_step_at_the_deadline_naming_its_rank(tiny_model):
    before = snapshot()
    llm = LLM(tiny_model, tensor_parallel_size=2, kvcache_block_size=16, step_timeout_s=5)
    worker = llm.executor.processes[0]
    try:
        _start_decoding(llm)
        os.kill(worker.pid, signal.SIGSTOP)  # alive, but never answers again
        with pytest.raises(WorkerFailedError,
                           match=r"worker rank 1 did not answer within step_timeout_s=5 s \(one step\); "
                                 r"every rank was stopped"):
            _step_until_error(llm, limit_s=60)
    finally:
        llm.shutdown()
        if worker.poll() is None:
            worker.kill()
    assert worker.returncode == -signal.SIGKILL
    assert_nothing_left(before)


def test_the_rank_that_died_is_named_not_a_peer_reporting_the_broken_connection(tiny_model):
    before = snapshot()
    llm = LLM(tiny_model, tensor_parallel_size=4, kvcache_block_size=16)
    try:
        _start_decoding(llm)
        llm.executor.processes[2].kill()  # rank 3; ranks 1 and 2 lose their connection to it
        with pytest.raises(WorkerFailedError, match="worker rank 3 was killed by signal SIGKILL"):
            _step_until_error(llm)
    finally:
        llm.shutdown()
    assert_nothing_left(before)


def test_sigkill_of_the_whole_process_group_leaves_no_segment(tiny_model):
    # what docker stop after its grace period or kill -9 -PGID do: no process gets to clean up
    process, segment, worker_pids = _start_rank0(tiny_model)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    _wait_gone(worker_pids, segment)


def test_ctrl_c_in_the_cli_exits_130_without_a_traceback(tiny_model):
    command = [sys.executable, "-m", "tpengine.cli", "generate", "--model", tiny_model, "--tp", "2", "--quiet",
               "--ignore-eos", "--max-tokens", "1000", "--block-size", "16", *["a prompt"] * 32]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, preexec_fn=_like_a_terminal_job)
    try:
        deadline = time.monotonic() + 120
        while not _worker_pids_of(process.pid):  # the engine is up: its workers run
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()[-3000:]
            time.sleep(0.1)
        workers = _worker_pids_of(process.pid)
        time.sleep(1.5)  # into generation
        os.killpg(process.pid, signal.SIGINT)
        _, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    assert all(is_gone(pid) for pid in workers)


def _worker_pids_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                is_worker = b"tpengine.runner.worker" in f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and is_worker:
            found.append(int(entry))
    return found
