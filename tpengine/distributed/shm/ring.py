"""Single-writer, multi-reader message ring in POSIX shared memory.

Rank 0 broadcasts one encoded message per engine step to the worker processes on
its host. Every reader sees every message in order; the writer only waits when
the slowest reader is ``num_slots`` chunks behind. A message larger than a slot
is streamed through consecutive slots as chunks, so any size fits.

Segment layout. Every counter is a native uint64 ("word"); counters are grouped
in 64-byte lines so that a reader bumping its own read count does not bounce the
cache line other processes poll::

    line 0                magic, num_readers, num_slots, slot_size,
                          error_capacity, writer_pid, writer_closed
    line 1 + r            reader r: read_count, pid, error_len, error_posted
    line 1 + N + s        slot s: seq, message_len
    control_bytes + ...   slot data:   num_slots * slot_size bytes
    ... then              error areas: num_readers * error_capacity bytes

Chunk ``k`` of the stream goes to slot ``k % num_slots`` and is published by
storing ``seq = k + 1`` after its bytes and ``message_len``; a reader whose read
count is ``k`` waits for that seq, copies the bytes, then stores ``k + 1`` as its
read count. The writer may fill chunk ``k`` once every read count exceeds
``k - num_slots``. Correctness rests on each side's shared-memory accesses becoming
visible in program order, which holds on x86 (TSO). Python cannot fence its stores on
a weakly ordered CPU such as aarch64, so the writer refuses to run there
(``stores_are_ordered``): callers use another channel.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from multiprocessing import shared_memory, util

from tpengine.distributed.shm import futex
from tpengine.distributed.shm.segment import PeerDiedError, attach_untracked, create_segment, pid_alive

__all__ = ["ShmRingReader", "ShmRingWriter", "stores_are_ordered"]

_TSO_MACHINES = ("x86_64", "amd64", "i386", "i686", "x86")


def stores_are_ordered(machine: str | None = None) -> bool:
    """Whether this CPU makes each process's stores visible in program order, as the ring needs."""
    return (platform.machine() if machine is None else machine).lower() in _TSO_MACHINES


_MAGIC = int.from_bytes(b"tpering1", "little")  # also versions the layout
_LINE_BYTES = 64  # one cache line
_LINE_WORDS = _LINE_BYTES // 8

# Words of line 0.
_MAGIC_WORD = 0
_NUM_READERS_WORD = 1
_NUM_SLOTS_WORD = 2
_SLOT_SIZE_WORD = 3
_ERROR_CAPACITY_WORD = 4
_WRITER_PID_WORD = 5
_WRITER_CLOSED_WORD = 6

# Word offsets inside a reader line.
_READ_COUNT = 0
_READER_PID = 1
_ERROR_LEN = 2
_ERROR_POSTED = 3

# Word offsets inside a slot line.
_SEQ = 0
_MESSAGE_LEN = 1

_DEFAULT_ERROR_CAPACITY = 16 << 10

# Busy-poll (yielding) this long first. The gap between two engine steps (rank 0 samples,
# schedules, encodes) is usually shorter, so a busy engine's next step lands within
# microseconds instead of after a grown sleep; an idle engine falls back to sleeps.
_SPIN_S = 2e-3
_FIRST_SLEEP_S = 20e-6
_MAX_SLEEP_S = 1e-3  # an idle waiter wakes at most ~1000 times a second
_PEER_CHECK_INTERVAL_S = 0.1


@dataclass(frozen=True)
class _Layout:
    num_readers: int
    num_slots: int
    slot_size: int
    error_capacity: int

    @property
    def control_bytes(self) -> int:
        return _LINE_BYTES * (1 + self.num_readers + self.num_slots)

    @property
    def total_bytes(self) -> int:
        return (
            self.control_bytes
            + self.num_slots * self.slot_size
            + self.num_readers * self.error_capacity
        )

    def reader_word(self, reader: int) -> int:
        return _LINE_WORDS * (1 + reader)

    def slot_word(self, slot: int) -> int:
        return _LINE_WORDS * (1 + self.num_readers + slot)

    def slot_data(self, slot: int) -> int:
        return self.control_bytes + slot * self.slot_size

    def error_data(self, reader: int) -> int:
        return self.control_bytes + self.num_slots * self.slot_size + reader * self.error_capacity


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _wait_until(
    ready: Callable[[], bool],
    deadline: float | None,
    check_peers: Callable[[], None],
    describe_wait: Callable[[], str],
    block: Callable[[float], None] | None = None,
) -> None:
    """Spin briefly, then sleep until ``ready()``: in ``block(timeout_s)`` (a futex wait that the
    other side wakes) where given, else polling with growing sleeps.

    ``check_peers`` runs every ``_PEER_CHECK_INTERVAL_S`` and raises when the other
    side can no longer make progress; ``TimeoutError`` is raised at ``deadline``.
    """
    spin_until = time.perf_counter() + _SPIN_S
    while time.perf_counter() < spin_until:
        if ready():
            return
        os.sched_yield()  # with more waiters than cores, let the process that has work run
    sleep_s = _FIRST_SLEEP_S
    next_peer_check = time.monotonic() + _PEER_CHECK_INTERVAL_S
    while not ready():
        now = time.monotonic()
        if now >= next_peer_check:
            try:
                check_peers()
            except (PeerDiedError, EOFError):
                if ready():  # the peer delivered before it died or closed
                    return
                raise
            next_peer_check = now + _PEER_CHECK_INTERVAL_S
        if deadline is not None:
            if now >= deadline:
                raise TimeoutError(f"timed out waiting for {describe_wait()}")
        if block is not None:
            block(min(next_peer_check, deadline or next_peer_check) - now)
            continue
        if deadline is not None:
            sleep_s = min(sleep_s, deadline - now)
        time.sleep(sleep_s)
        sleep_s = min(sleep_s * 2, _MAX_SLEEP_S)


def _release_writer_segment(segment: shared_memory.SharedMemory, words: memoryview, linked: list[bool]) -> None:
    try:
        words[_WRITER_CLOSED_WORD] = 1  # lets waiting readers tell a shutdown from a hang
        words.release()
        segment.close()
    finally:
        _unlink_once(segment, linked)


def _unlink_once(segment: shared_memory.SharedMemory, linked: list[bool]) -> None:
    if linked[0]:
        linked[0] = False
        segment.unlink()


class ShmRingWriter:
    """The single producer. Creates, owns and finally unlinks the segment."""

    def __init__(
        self,
        num_readers: int,
        *,
        num_slots: int = 8,
        slot_size: int = 1 << 20,
        error_capacity: int = _DEFAULT_ERROR_CAPACITY,
    ) -> None:
        if num_readers < 1 or num_slots < 1 or slot_size < 1:
            raise ValueError("num_readers, num_slots and slot_size must be positive")
        if error_capacity < 1:
            raise ValueError("error_capacity must be positive")
        if not stores_are_ordered():
            raise RuntimeError(f"the shared-memory ring relies on x86 store ordering; this CPU is "
                               f"{platform.machine()}: use the broadcast channel")
        layout = _Layout(num_readers, num_slots, slot_size, error_capacity)
        self._layout = layout
        self._segment = create_segment(layout.total_bytes)
        self._buf = self._segment.buf
        self._words = self._buf[: layout.control_bytes].cast("Q")
        self._base_address = futex.address_of(self._buf) if futex.available() else None
        # Runs on close(), garbage collection, interpreter exit and multiprocessing-child exit
        # (fork/forkserver children skip atexit); never in a forked copy of this process.
        self._linked = [True]
        self._finalizer = util.Finalize(
            self, _release_writer_segment, (self._segment, self._words, self._linked), exitpriority=0
        )

        words = self._words
        words[_NUM_READERS_WORD] = num_readers
        words[_NUM_SLOTS_WORD] = num_slots
        words[_SLOT_SIZE_WORD] = slot_size
        words[_ERROR_CAPACITY_WORD] = error_capacity
        words[_WRITER_PID_WORD] = os.getpid()
        words[_MAGIC_WORD] = _MAGIC  # last: marks the header complete

        self._slot_words = [layout.slot_word(s) for s in range(num_slots)]
        self._slot_starts = [layout.slot_data(s) for s in range(num_slots)]
        self._read_counts = slice(
            layout.reader_word(0) + _READ_COUNT, layout.reader_word(num_readers), _LINE_WORDS
        )
        self._chunks_written = 0
        self._slowest_read_count = 0  # cached lower bound; refreshed only when the ring looks full
        self._torn = False

    @property
    def name(self) -> str:
        """Segment name that readers attach with."""
        return self._segment.name

    def write(self, payload: bytes | bytearray | memoryview, timeout: float | None = None) -> None:
        """Publish one message to every reader, waiting while the ring is full.

        Raises ``TimeoutError`` after ``timeout`` seconds and ``PeerDiedError`` if a
        reader that holds up the ring has died. If that happens after part of a
        multi-slot message went out, readers hold half a message and the writer
        refuses further writes.
        """
        if self._torn:
            raise RuntimeError(f"shm ring {self.name}: an earlier write stopped mid-message")
        data = memoryview(payload).cast("B")
        total = len(data)
        slot_size = self._layout.slot_size
        deadline = _deadline(timeout)
        first_chunk = self._chunks_written
        try:
            offset = 0
            while True:
                chunk = data[offset : offset + slot_size]
                self._publish_chunk(chunk, total, deadline)
                offset += len(chunk)
                if offset >= total:
                    return
        except BaseException:
            if self._chunks_written != first_chunk:
                self._torn = True
            raise

    def _publish_chunk(self, chunk: memoryview, total: int, deadline: float | None) -> None:
        index = self._chunks_written
        if index - self._slowest_read_count >= self._layout.num_slots:
            self._wait_for_space(index, deadline)
        slot = index % self._layout.num_slots
        start = self._slot_starts[slot]
        self._buf[start : start + len(chunk)] = chunk
        meta = self._slot_words[slot]
        self._words[meta + _MESSAGE_LEN] = total
        self._words[meta + _SEQ] = index + 1  # published last: the bytes above are complete
        if self._base_address is not None:  # readers past their spin sleep on this word
            futex.wake(self._base_address + 8 * (meta + _SEQ))
        self._chunks_written = index + 1

    def _wait_for_space(self, index: int, deadline: float | None) -> None:
        needed_read_count = index - self._layout.num_slots + 1

        def has_space() -> bool:
            self._slowest_read_count = min(self._words[self._read_counts])
            return self._slowest_read_count >= needed_read_count

        def lagging_readers() -> list[int]:
            readers = range(self._layout.num_readers)
            return [r for r in readers if self._read_count_of(r) < needed_read_count]

        _wait_until(
            has_space,
            deadline,
            lambda: self._raise_if_dead(lagging_readers()),
            lambda: f"readers {lagging_readers()} to free a slot of shm ring {self.name}",
        )

    def wait_for_readers(self, timeout: float | None) -> None:
        """Wait until every reader has attached; ``TimeoutError`` names the missing ones."""

        def unregistered() -> list[int]:
            return [r for r in range(self._layout.num_readers) if not self._reader_pid(r)]

        _wait_until(
            lambda: not unregistered(),
            _deadline(timeout),
            lambda: self._raise_if_dead(range(self._layout.num_readers)),
            lambda: f"readers {unregistered()} to attach to shm ring {self.name}",
        )

    def reader_errors(self) -> dict[int, bytes]:
        """Error reports posted by readers, keyed by reader index."""
        errors = {}
        for reader in range(self._layout.num_readers):
            line = self._layout.reader_word(reader)
            if self._words[line + _ERROR_POSTED]:
                start = self._layout.error_data(reader)
                errors[reader] = bytes(self._buf[start : start + self._words[line + _ERROR_LEN]])
        return errors

    def _read_count_of(self, reader: int) -> int:
        return self._words[self._layout.reader_word(reader) + _READ_COUNT]

    def _reader_pid(self, reader: int) -> int:
        return self._words[self._layout.reader_word(reader) + _READER_PID]

    def _raise_if_dead(self, readers: Iterable[int]) -> None:
        for reader in readers:
            pid = self._reader_pid(reader)
            if pid and not pid_alive(pid):
                raise PeerDiedError(f"reader {reader} (pid {pid}) of shm ring {self.name} died")

    def lagging_readers(self) -> list[int]:
        """Readers that have not yet taken every chunk written so far."""
        return [r for r in range(self._layout.num_readers) if self._read_count_of(r) < self._chunks_written]

    def unlink(self) -> None:
        """Remove the segment's name now; mappings stay valid, so call it once every reader attached.

        Then no way the processes end (even SIGKILL of them all) can leave the segment behind.
        """
        _unlink_once(self._segment, self._linked)

    def close(self) -> None:
        """Unlink the segment (if still linked) and unmap it; idempotent. Attached readers keep their mapping."""
        self._finalizer()

    def __enter__(self) -> ShmRingWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class ShmRingReader:
    """One consumer, identified by its index in ``range(num_readers)``."""

    def __init__(self, name: str, reader_index: int) -> None:
        self._name = name
        self._index = reader_index
        self._mmap = attach_untracked(name)
        self._buf = memoryview(self._mmap)
        self._words = self._buf[:_LINE_BYTES].cast("Q")  # line 0 only, until the layout is known
        try:
            layout = self._read_layout()
            self._writer_pid = self._words[_WRITER_PID_WORD]
            self._words.release()
            self._words = self._buf[: layout.control_bytes].cast("Q")
            self._line = layout.reader_word(reader_index)
            self._claim_reader_index()
        except BaseException:
            self.close()
            raise
        self._layout = layout
        self._slot_words = [layout.slot_word(s) for s in range(layout.num_slots)]
        self._slot_starts = [layout.slot_data(s) for s in range(layout.num_slots)]
        # Resumes where an earlier attach under this index stopped.
        self._read_count = self._words[self._line + _READ_COUNT]
        self._base_address = futex.address_of(self._mmap) if futex.available() else None
        self._partial: bytearray | None = None  # a multi-slot message being assembled
        self._partial_filled = 0

    def _read_layout(self) -> _Layout:
        words = self._words
        if words[_MAGIC_WORD] != _MAGIC:
            raise ValueError(f"{self._name} is not a tpengine shm ring")
        layout = _Layout(
            words[_NUM_READERS_WORD],
            words[_NUM_SLOTS_WORD],
            words[_SLOT_SIZE_WORD],
            words[_ERROR_CAPACITY_WORD],
        )
        if len(self._buf) < layout.total_bytes:
            raise ValueError(f"shm ring {self._name} is smaller than its header says")
        if not 0 <= self._index < layout.num_readers:
            raise ValueError(f"reader_index {self._index} not in range({layout.num_readers})")
        return layout

    def _claim_reader_index(self) -> None:
        owner = self._words[self._line + _READER_PID]
        if owner not in (0, os.getpid()) and pid_alive(owner):
            raise ValueError(
                f"reader {self._index} of shm ring {self._name} is taken by live pid {owner}"
            )
        self._words[self._line + _READER_PID] = os.getpid()

    @property
    def name(self) -> str:
        return self._name

    def read(self, timeout: float | None = None) -> bytes:
        """Return the next message, in write order.

        Raises ``TimeoutError`` after ``timeout`` seconds (the stream stays intact, a
        later read resumes), ``PeerDiedError`` if the writer died and ``EOFError`` once
        the writer closed the ring and every message was read.
        """
        deadline = _deadline(timeout)
        slot_size = self._layout.slot_size
        while True:
            slot = self._wait_for_chunk(deadline)
            total = self._words[self._slot_words[slot] + _MESSAGE_LEN]
            start = self._slot_starts[slot]
            if self._partial is None and total <= slot_size:
                message = bytes(self._buf[start : start + total])
                self._consume_chunk()
                return message
            if self._partial is None:
                self._partial = bytearray(total)
                self._partial_filled = 0
            filled = self._partial_filled
            size = min(slot_size, total - filled)
            self._partial[filled : filled + size] = self._buf[start : start + size]
            self._partial_filled = filled + size
            self._consume_chunk()
            if self._partial_filled == total:
                message = bytes(self._partial)
                self._partial = None
                return message

    def _wait_for_chunk(self, deadline: float | None) -> int:
        slot = self._read_count % self._layout.num_slots
        seq_word = self._slot_words[slot] + _SEQ
        expected = self._read_count + 1
        if self._words[seq_word] != expected:
            block = None
            if self._base_address is not None:  # the writer wakes this word when it publishes
                address = self._base_address + 8 * seq_word
                block = lambda timeout_s: futex.wait(address, self._words[seq_word], timeout_s)  # noqa: E731
            _wait_until(
                lambda: self._words[seq_word] == expected,
                deadline,
                self._raise_if_writer_gone,
                lambda: f"message chunk {expected} of shm ring {self._name}",
                block,
            )
        return slot

    def _consume_chunk(self) -> None:
        self._read_count += 1
        self._words[self._line + _READ_COUNT] = self._read_count  # after the copy: frees the slot

    def _raise_if_writer_gone(self) -> None:
        if not pid_alive(self._writer_pid):
            raise PeerDiedError(f"writer (pid {self._writer_pid}) of shm ring {self._name} died")
        if self._words[_WRITER_CLOSED_WORD]:
            raise EOFError(f"writer closed shm ring {self._name}")

    @property
    def error_capacity(self) -> int:
        """The most bytes post_error takes."""
        return self._layout.error_capacity

    def post_error(self, payload: bytes) -> None:
        """Leave an error report (e.g. a traceback) for the writer.

        ValueError when it exceeds ``error_capacity``: cutting an encoded report would leave the
        writer bytes it cannot decode, so the caller shortens its text before encoding.
        """
        capacity = self._layout.error_capacity
        if len(payload) > capacity:
            raise ValueError(f"error report of {len(payload)} bytes exceeds the ring's {capacity}-byte error slot")
        start = self._layout.error_data(self._index)
        self._words[self._line + _ERROR_POSTED] = 0
        self._buf[start : start + len(payload)] = payload
        self._words[self._line + _ERROR_LEN] = len(payload)
        self._words[self._line + _ERROR_POSTED] = 1

    def close(self) -> None:
        """Unmap the segment; idempotent. Never unlinks: the writer owns the segment."""
        self._words.release()
        self._buf.release()
        self._mmap.close()

    def __enter__(self) -> ShmRingReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
