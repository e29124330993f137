"""ShmRingWriter / ShmRingReader across real processes and real shared memory."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from multiprocessing import shared_memory

import pytest

from tests.distributed.channels import payload
from tpengine.distributed.shm.ring import ShmRingReader, ShmRingWriter, stores_are_ordered
from tpengine.distributed.shm.segment import PeerDiedError

# Fresh processes like "spawn", but `import tpengine` (which loads torch) is paid once by the
# fork server rather than by every child; a spawn start is covered by the scenario scripts below.
CTX = multiprocessing.get_context("forkserver")
CTX.set_forkserver_preload(["tpengine.distributed.shm.ring", __name__])
CHILD_TIMEOUT_S = 30


def _random_sizes(count: int, max_size: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(0, max_size) for _ in range(count)]


def _segment_exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")


@contextlib.contextmanager
def _children(*specs, context=CTX):
    """Start one process per (target, args); kill whatever is still running on exit."""
    processes = []
    try:
        for target, args in specs:
            process = context.Process(target=target, args=args, daemon=True)
            process.start()
            processes.append(process)
        yield processes
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join()


def _join_ok(processes) -> None:
    for process in processes:
        process.join(CHILD_TIMEOUT_S)
        assert process.exitcode == 0, f"child {process.name} exit code {process.exitcode}"


def _kill_later(pid: int, delay_s: float) -> threading.Timer:
    timer = threading.Timer(delay_s, os.kill, (pid, signal.SIGKILL))
    timer.start()
    return timer


def _unlink_leftover(name: str) -> None:
    """Remove a segment whose writer was SIGKILLed (also drops it from the resource tracker)."""
    with contextlib.suppress(FileNotFoundError):
        segment = shared_memory.SharedMemory(name=name)
        segment.close()
        segment.unlink()


# Child process bodies. An AssertionError makes the child exit non-zero.


def _expect_messages(name: str, reader_index: int, sizes: list[int]) -> None:
    with ShmRingReader(name, reader_index) as reader:
        for index, size in enumerate(sizes):
            received = reader.read(timeout=CHILD_TIMEOUT_S)
            assert received == payload(index, size), f"message {index} differs"


def _expect_messages_after(go, name: str, reader_index: int, sizes: list[int]) -> None:
    with ShmRingReader(name, reader_index):  # attach (register) now, read only after go
        go.wait(CHILD_TIMEOUT_S)
        _expect_messages(name, reader_index, sizes)


def _attach_and_sleep(name: str, reader_index: int) -> None:
    with ShmRingReader(name, reader_index):
        time.sleep(60)


def _write_then_sleep(names) -> None:
    writer = ShmRingWriter(1, num_slots=2, slot_size=64)
    writer.write(b"hello")
    names.put(writer.name)
    time.sleep(60)


_kept_writers = []


def _create_writer_then_exit(names, how: str) -> None:
    # Kept alive in a global, so only the exit-time cleanup can unlink it.
    _kept_writers.append(ShmRingWriter(1, num_slots=2, slot_size=64))
    names.put(_kept_writers[0].name)
    if how == "raise":
        raise RuntimeError("deliberate failure in the writer process")


def _measure_idle_read(name: str, results) -> None:
    with ShmRingReader(name, 0) as reader:
        cpu_start, wall_start = time.process_time(), time.monotonic()
        with contextlib.suppress(TimeoutError):
            reader.read(timeout=1.0)
        results.put((time.process_time() - cpu_start, time.monotonic() - wall_start))


def _post_error(name: str, reader_index: int, report: bytes) -> None:
    with ShmRingReader(name, reader_index) as reader:
        reader.post_error(report)


def _write_all(writer: ShmRingWriter, sizes: list[int]) -> None:
    for index, size in enumerate(sizes):
        writer.write(payload(index, size), timeout=CHILD_TIMEOUT_S)


# Delivery.


@pytest.mark.parametrize(
    ("num_slots", "slot_size", "sizes"),
    [
        (8, 4096, _random_sizes(3000, 300)),  # ~375 laps of the ring, one slot per message
        (4, 64, _random_sizes(2000, 200)),  # messages of 0-4 chunks, chunk boundaries everywhere
    ],
    ids=["in_order_many_laps", "chunked_wraparound"],
)
def test_messages_arrive_in_order(num_slots, slot_size, sizes):
    with ShmRingWriter(1, num_slots=num_slots, slot_size=slot_size) as writer:
        with _children((_expect_messages, (writer.name, 0, sizes))) as readers:
            _write_all(writer, sizes)
            _join_ok(readers)


def test_messages_larger_than_a_slot_and_the_whole_ring_arrive_intact():
    slot_size, num_slots = 4096, 4  # 16 KiB ring
    sizes = [slot_size + 1, 10_000, slot_size, 0, 3_000_000, 5, 2 * slot_size * num_slots + 7]
    with ShmRingWriter(1, num_slots=num_slots, slot_size=slot_size) as writer:
        with _children((_expect_messages, (writer.name, 0, sizes))) as readers:
            _write_all(writer, sizes)
            _join_ok(readers)


def test_three_readers_each_receive_everything_in_order():
    sizes = _random_sizes(1500, 3000)  # some span several 1 KiB slots
    with ShmRingWriter(3, num_slots=8, slot_size=1024) as writer:
        specs = [(_expect_messages, (writer.name, index, sizes)) for index in range(3)]
        with _children(*specs) as readers:
            _write_all(writer, sizes)
            _join_ok(readers)


def test_writer_blocks_while_ring_is_full_and_resumes_when_reader_catches_up():
    num_slots = 4
    sizes = [32] * (num_slots + 20)
    go = CTX.Event()
    with ShmRingWriter(1, num_slots=num_slots, slot_size=64) as writer:
        with _children((_expect_messages_after, (go, writer.name, 0, sizes))) as readers:
            writer.wait_for_readers(timeout=CHILD_TIMEOUT_S)
            _write_all(writer, sizes[:num_slots])
            started = time.monotonic()
            with pytest.raises(TimeoutError, match=r"readers \[0\]"):
                writer.write(payload(num_slots, 32), timeout=0.3)
            assert time.monotonic() - started >= 0.3
            go.set()
            for index in range(num_slots, len(sizes)):
                writer.write(payload(index, sizes[index]), timeout=CHILD_TIMEOUT_S)
            _join_ok(readers)


# Peer death, timeouts and shutdown.


def test_writer_waiting_on_full_ring_raises_when_reader_is_killed():
    # Spawned as our own child, the killed reader lingers as a zombie, as engine workers do.
    spawn = multiprocessing.get_context("spawn")
    with ShmRingWriter(1, num_slots=2, slot_size=64) as writer:
        with _children((_attach_and_sleep, (writer.name, 0)), context=spawn) as (reader,):
            writer.wait_for_readers(timeout=CHILD_TIMEOUT_S)
            writer.write(b"a")
            writer.write(b"b")
            killer = _kill_later(reader.pid, 0.2)
            try:
                started = time.monotonic()
                with pytest.raises(PeerDiedError, match=rf"reader 0 \(pid {reader.pid}\)"):
                    writer.write(b"c", timeout=10)
                assert time.monotonic() - started < 2.2
            finally:
                killer.cancel()


def test_waiting_reader_raises_when_writer_is_killed():
    names = CTX.Queue()
    with _children((_write_then_sleep, (names,))) as (writer,):
        name = names.get(timeout=CHILD_TIMEOUT_S)
        killer = _kill_later(writer.pid, 0.2)
        try:
            with ShmRingReader(name, 0) as reader:
                assert reader.read(timeout=CHILD_TIMEOUT_S) == b"hello"
                started = time.monotonic()
                with pytest.raises(PeerDiedError, match=rf"writer \(pid {writer.pid}\)"):
                    reader.read(timeout=10)
                assert time.monotonic() - started < 2.2
        finally:
            killer.cancel()
            _unlink_leftover(name)


def test_read_timeout_then_eof_after_writer_closes():
    writer = ShmRingWriter(1, num_slots=2, slot_size=64)
    with ShmRingReader(writer.name, 0) as reader:
        with pytest.raises(TimeoutError):
            reader.read(timeout=0.05)
        writer.write(b"last words")
        writer.close()
        assert reader.read(timeout=1) == b"last words"  # delivered before the close
        with pytest.raises(EOFError):
            reader.read(timeout=5)


def test_wait_for_readers_names_the_reader_that_never_attached():
    with ShmRingWriter(2, num_slots=2, slot_size=64) as writer:
        with ShmRingReader(writer.name, 0):
            with pytest.raises(TimeoutError, match=r"readers \[1\] to attach"):
                writer.wait_for_readers(timeout=0.2)
            with ShmRingReader(writer.name, 1):
                writer.wait_for_readers(timeout=1)


def test_reader_timeout_mid_message_resumes_where_it_stopped():
    message = payload(0, 1000)  # 16 chunks through a 4-slot ring
    with ShmRingWriter(2, num_slots=4, slot_size=64) as writer:
        with ShmRingReader(writer.name, 0) as fast, ShmRingReader(writer.name, 1) as slow:
            sender = threading.Thread(target=writer.write, args=(message, 10))
            sender.start()
            try:
                with pytest.raises(TimeoutError):
                    fast.read(timeout=0.2)  # gets 4 chunks, then the writer waits for `slow`
                slow_result = []
                receiver = threading.Thread(
                    target=lambda: slow_result.append(slow.read(timeout=10))
                )
                receiver.start()
                assert fast.read(timeout=10) == message
                receiver.join()
                assert slow_result == [message]
            finally:
                sender.join()


def test_writer_timeout_mid_message_refuses_further_writes():
    with ShmRingWriter(1, num_slots=4, slot_size=64) as writer:
        with ShmRingReader(writer.name, 0):
            with pytest.raises(TimeoutError):
                writer.write(bytes(1000), timeout=0.1)
            with pytest.raises(RuntimeError, match="mid-message"):
                writer.write(b"x")


# Segment lifetime.


def test_close_unlinks_segment_and_is_idempotent():
    writer = ShmRingWriter(1, num_slots=2, slot_size=64)
    assert writer.name.startswith(f"tpengine_{os.getpid()}_")
    assert _segment_exists(writer.name)
    writer.close()
    assert not _segment_exists(writer.name)
    writer.close()


def test_context_manager_unlinks_segment_on_exception():
    with pytest.raises(ValueError), ShmRingWriter(1, num_slots=2, slot_size=64) as writer:
        name = writer.name
        raise ValueError("boom")
    assert not _segment_exists(name)


@pytest.mark.parametrize("how", ["return", "raise"])
def test_writer_process_exit_unlinks_segment(how):
    names = CTX.Queue()
    with _children((_create_writer_then_exit, (names, how))) as (child,):
        name = names.get(timeout=CHILD_TIMEOUT_S)
        child.join(CHILD_TIMEOUT_S)
        assert child.exitcode == (0 if how == "return" else 1)
    try:
        assert not _segment_exists(name)
    finally:
        _unlink_leftover(name)


WRITER_DIES_OF_EXCEPTION = """
from tpengine.distributed.shm.ring import ShmRingWriter

writer = ShmRingWriter(1, num_slots=2, slot_size=64)
print(writer.name, flush=True)
raise RuntimeError("uncaught, with the writer still open")
"""


def test_interpreter_exit_on_uncaught_exception_unlinks_segment():
    result = subprocess.run(
        [sys.executable, "-c", WRITER_DIES_OF_EXCEPTION], capture_output=True, text=True, timeout=60
    )
    name = result.stdout.strip()
    try:
        assert result.returncode == 1 and "uncaught, with the writer still open" in result.stderr
        assert name.startswith("tpengine_") and not _segment_exists(name)
        assert "resource_tracker" not in result.stderr  # unlinked by us, not by the leak reaper
    finally:
        _unlink_leftover(name)


READER_EXIT_SCENARIO = """
import multiprocessing
import os

from tpengine.distributed.shm.ring import ShmRingReader, ShmRingWriter


def reader_main(name, index):
    reader = ShmRingReader(name, index)
    assert reader.read(timeout=30) == b"first"
    if index == 0:
        reader.close()  # reader 1 just exits with the segment still mapped


if __name__ == "__main__":
    ctx = multiprocessing.get_context("spawn")
    with ShmRingWriter(2, num_slots=2, slot_size=64) as writer:
        writer.write(b"first")
        children = [ctx.Process(target=reader_main, args=(writer.name, i)) for i in range(2)]
        for child in children:
            child.start()
        for child in children:
            child.join(30)
            assert child.exitcode == 0, child.exitcode
        assert os.path.exists("/dev/shm/" + writer.name), "a reader unlinked the segment"
        writer.write(b"second")
    print("scenario done")
"""


def test_reader_exit_neither_unlinks_segment_nor_warns(tmp_path):
    # A fresh interpreter owns its resource tracker, so any tracker complaint lands in its stderr;
    # its spawned readers share that tracker, the case where register+unregister would misfire.
    script = tmp_path / "reader_exit_scenario.py"
    script.write_text(textwrap.dedent(READER_EXIT_SCENARIO))
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "scenario done" in result.stdout
    assert result.stderr == ""


# Idle cost and error reports.


def test_idle_reader_uses_little_cpu():
    results = CTX.Queue()
    with ShmRingWriter(1, num_slots=2, slot_size=64) as writer:
        with _children((_measure_idle_read, (writer.name, results))) as readers:
            cpu_s, wall_s = results.get(timeout=CHILD_TIMEOUT_S)
            _join_ok(readers)
    assert wall_s >= 1.0
    assert cpu_s < 0.3 * wall_s, f"idle reader used {cpu_s:.3f} s CPU in {wall_s:.3f} s"


def test_post_error_reaches_the_writer():
    report = b"Traceback (most recent call last):\n  ...\nValueError: worker 1 failed\n"
    with ShmRingWriter(2, num_slots=2, slot_size=64) as writer:
        assert writer.reader_errors() == {}
        with _children((_post_error, (writer.name, 1, report))) as readers:
            _join_ok(readers)
        assert writer.reader_errors() == {1: report}


def test_overlong_error_report_is_refused_whole_and_nothing_is_posted():
    # a cut encoded report would be undecodable: the poster shortens its text before encoding
    with ShmRingWriter(1, num_slots=2, slot_size=64, error_capacity=4096) as writer:
        with ShmRingReader(writer.name, 0) as reader:
            assert reader.error_capacity == 4096
            with pytest.raises(ValueError, match="100000 bytes exceeds the ring's 4096-byte error slot"):
                reader.post_error(b"x" * 100_000)
            reader.post_error(b"y" * 4096)
        assert writer.reader_errors() == {0: b"y" * 4096}


def test_unlinked_segment_keeps_carrying_messages_to_attached_readers():
    with ShmRingWriter(1, num_slots=2, slot_size=64) as writer:
        with ShmRingReader(writer.name, 0) as reader:
            writer.unlink()
            assert not _segment_exists(writer.name)
            writer.write(b"after unlink")
            assert writer.lagging_readers() == [0]
            assert reader.read(timeout=5) == b"after unlink"
            assert writer.lagging_readers() == []
    # close() after unlink() neither raises nor warns


@pytest.mark.parametrize(("machine", "ordered"), [("x86_64", True), ("AMD64", True), ("aarch64", False),
                                                  ("arm64", False), ("ppc64le", False)])
def test_only_x86_counts_as_ordering_stores(machine, ordered):
    assert stores_are_ordered(machine) is ordered
