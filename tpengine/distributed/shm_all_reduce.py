"""Sum all-reduce through one shared-memory segment, for tensor-parallel ranks on one host.

Rank 0 creates the segment, every other rank maps it, and rank 0 unlinks its name as soon as all have
(``connect``): from then on no way the processes end can leave it in /dev/shm. The C++ op
(kernels/cpu/shm_allreduce.cpp) copies this rank's tensor in, waits for the peers with bounded
spinning and sums every rank's copy in rank order, so every rank gets the same bits, equal to
``t_0 + t_1 + ... + t_{n-1}``; a tensor larger than a slot goes through in pieces. When a wait
outlasts the op's spin, the wait goes on here, checking that the lagging peers are still alive.

``gather_to_first`` (rank 0 gets every rank's tensor, in rank order) uses the same slots and sequence
numbers from Python: each piece is a chunk as in the all-reduce (copy into this rank's slot, publish,
wait until every rank has published), after which rank 0 copies the slots out. Every rank waits for
every rank on each piece, as in the all-reduce, so the two-slot argument of the C++ op covers both.
The ready word is published with a plain store after the copy, which orders it after the slot's
bytes only on a CPU that keeps stores in order (x86: ``ORDERED_STORES``); elsewhere the gather is not
offered and the group gathers through gloo.

Segment layout, native uint64 words in 64-byte lines::

    line 0                magic, world_size, slot_bytes
    line 1 + r            rank r: ready_seq, chunk_bytes (two: by seq parity), pid
    control_bytes + ...   rank r's two slots of slot_bytes each, rank after rank
"""
from __future__ import annotations

import os
import platform
from collections.abc import Callable
from multiprocessing import shared_memory, util

import torch

from tpengine.distributed.shm_ring import (PeerDiedError, _attach_untracked, _pid_alive, _segment_name,
                                           _wait_until)

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEFAULT_SLOT_BYTES = 1 << 20  # a decode step's tensor fits whole; a prefill pass's goes in a few pieces

_MAGIC = int.from_bytes(b"tpeallr1", "little")  # also versions the layout
_LINE_WORDS = 8
_NAME_BYTES = 128
_MAGIC_WORD, _WORLD_SIZE_WORD, _SLOT_BYTES_WORD = 0, 1, 2
_READY_SEQ, _PID = 0, 3  # words of a rank's line; 1 and 2 are the C++ op's chunk sizes
_SPIN_S = 1e-3  # the op's own spin per call; longer waits continue in _wait_for_peers
_CHUNK_BYTES = 1  # + seq % 2, as in the C++ op
# stores become visible to other cores in program order (x86-TSO): the Python gather relies on it
ORDERED_STORES = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def _control_words(world_size: int) -> int:
    return _LINE_WORDS * (1 + world_size)


def _segment_bytes(world_size: int, slot_bytes: int) -> int:
    return 8 * _control_words(world_size) + world_size * 2 * slot_bytes


class ShmAllReduce:
    """This rank's end of the segment: rank 0 creates it (``name=None``), the others attach by name."""

    def __init__(self, rank: int, world_size: int, name: str | None = None, slot_bytes: int = DEFAULT_SLOT_BYTES):
        from tpengine.kernels.cpu.shm_allreduce import load
        load()
        if world_size < 2 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} of world size {world_size}: the all-reduce needs 2 or more ranks")
        if slot_bytes < 64 or slot_bytes % 64:
            raise ValueError(f"slot_bytes must be a positive multiple of 64, got {slot_bytes}")
        self.rank = rank
        self.world_size = world_size
        self._seq = 0  # chunks reduced so far; the same count on every rank
        self._broken = False
        self._aborted = False
        self._op = torch.ops.tpengine_shm.all_reduce
        self._segment: shared_memory.SharedMemory | None = None
        if name is None:
            self._segment = shared_memory.SharedMemory(_segment_name(), create=True,
                                                       size=_segment_bytes(world_size, slot_bytes))
            # unlinks on close(), garbage collection or exit if connect() never got to it
            self._unlink_finalizer = util.Finalize(self, _unlink, (self._segment,), exitpriority=0)
            name = self._segment.name
            self._segment.close()  # its own mapping; the tensors below view this rank's mapping, as on the others
        self.name, self._mapping = name, _attach_untracked(name)
        self._words = memoryview(self._mapping).cast("Q")
        words = self._words
        if self._segment is not None:
            words[_WORLD_SIZE_WORD], words[_SLOT_BYTES_WORD] = world_size, slot_bytes
            words[_MAGIC_WORD] = _MAGIC
        elif (words[_MAGIC_WORD], words[_WORLD_SIZE_WORD]) != (_MAGIC, world_size):
            self.close()
            raise ValueError(f"{name} is not a tpengine all-reduce segment for {world_size} ranks")
        self.slot_bytes = words[_SLOT_BYTES_WORD]
        words[self._line(rank) + _PID] = os.getpid()
        control = _control_words(world_size)
        self._control = torch.frombuffer(self._mapping, dtype=torch.int64, count=control)
        self._slots = torch.frombuffer(self._mapping, dtype=torch.uint8, offset=8 * control,
                                       count=world_size * 2 * self.slot_bytes).view(world_size, 2, self.slot_bytes)

    @staticmethod
    def _line(rank: int) -> int:
        return _LINE_WORDS * (1 + rank)

    def supports(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.dtype in SUPPORTED_DTYPES

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum tensor over the ranks, in place; every rank calls it with a tensor of the same size.

        PeerDiedError when a rank it waits for has died; the all-reduce is then unusable.
        """
        if self._broken:
            raise RuntimeError(f"shm all-reduce {self.name}: an earlier all-reduce failed midway")
        data = tensor if tensor.is_contiguous() else tensor.contiguous()
        flat = data.view(-1)
        chunk_elements = self.slot_bytes // flat.element_size()
        num_chunks = -(-flat.numel() // chunk_elements)
        try:
            done = self._op(flat, self._control, self._slots, self.rank, self._seq, 0, False, _SPIN_S)
            while done < num_chunks:
                self._wait_for_peers(self._seq + done + 1)
                done = self._op(flat, self._control, self._slots, self.rank, self._seq, done, True, _SPIN_S)
        except BaseException:
            self._broken = True  # the ranks' chunk counts may now disagree
            raise
        self._seq += num_chunks
        if data is not tensor:
            tensor.copy_(data)

    def supports_gather(self, tensor: torch.Tensor) -> bool:
        return ORDERED_STORES and self.supports(tensor)

    def gather_to_first(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's tensor, in rank order, on rank 0 (bit for bit); None on the other ranks. Every
        rank calls it with a tensor of the same size and dtype.

        PeerDiedError when a rank it waits for has died; the segment is then unusable.
        """
        if self._broken:
            raise RuntimeError(f"shm all-reduce {self.name}: an earlier all-reduce failed midway")
        data = tensor if tensor.is_contiguous() else tensor.contiguous()
        flat = data.view(-1).view(torch.uint8)  # bytes: copied, never added, so every bit survives
        total = flat.numel()
        num_chunks = max(1, -(-total // self.slot_bytes))
        outputs = [torch.empty_like(data) for _ in range(self.world_size)] if self.rank == 0 else None
        out_bytes = [o.view(-1).view(torch.uint8) for o in outputs] if outputs is not None else None
        words, own_line = self._words, self._line(self.rank)
        try:
            for c in range(num_chunks):
                seq = self._seq + c + 1
                begin = c * self.slot_bytes
                n = min(self.slot_bytes, total - begin)
                if self.rank != 0:  # rank 0 copies its own piece straight from its tensor
                    self._slots[self.rank, seq % 2, :n].copy_(flat[begin:begin + n])
                words[own_line + _CHUNK_BYTES + seq % 2] = n
                words[own_line + _READY_SEQ] = seq  # last: the slot is complete
                if not self._all_published(seq):
                    self._wait_for_peers(seq)
                if self.rank == 0:
                    for r in range(self.world_size):
                        if words[self._line(r) + _CHUNK_BYTES + seq % 2] != n:
                            raise RuntimeError(f"shm gather: rank {r} gathers a tensor of another size than rank 0")
                    out_bytes[0][begin:begin + n].copy_(flat[begin:begin + n])
                    for r in range(1, self.world_size):
                        out_bytes[r][begin:begin + n].copy_(self._slots[r, seq % 2, :n])
        except BaseException:
            self._broken = True
            raise
        self._seq += num_chunks
        return outputs

    def _all_published(self, seq: int) -> bool:
        words = self._words
        return all(words[self._line(r) + _READY_SEQ] >= seq for r in range(self.world_size))

    def _wait_for_peers(self, seq: int) -> None:
        words = self._words

        def lagging() -> list[int]:
            return [r for r in range(self.world_size) if words[self._line(r) + _READY_SEQ] < seq]

        def check_peers() -> None:
            if self._aborted:
                raise RuntimeError(f"shm all-reduce {self.name} was aborted while waiting for ranks {lagging()}")
            for rank in lagging():
                pid = words[self._line(rank) + _PID]
                if not _pid_alive(pid):
                    raise PeerDiedError(f"tensor-parallel rank {rank} (pid {pid}) died during an all-reduce")

        _wait_until(lambda: not lagging(), None, check_peers,
                    lambda: f"ranks {lagging()} in all-reduce {self.name}")

    def abort(self) -> None:
        """From another thread: make a wait for the peers raise within a peer check; the mapping stays
        (that thread may be reading it)."""
        self._aborted = True

    def unlink(self) -> None:
        """Rank 0: remove the segment's name; every rank's mapping stays valid. Idempotent."""
        if self._segment is not None:
            self._unlink_finalizer()

    def close(self) -> None:
        """Unmap the segment (rank 0 unlinks it first if it has not yet); idempotent."""
        self.unlink()
        self._control = self._slots = None  # views of the mapping: they must go before it can close
        if self._words is not None:
            self._words.release()
            self._words = None
            self._mapping.close()


def _unlink(segment: shared_memory.SharedMemory) -> None:
    segment.unlink()


_NO_KERNEL, _CANNOT_MAP, _NO_SEGMENT = 1, 2, 3
_PROBLEMS = {_NO_KERNEL: "rank {rank} has no C++ all-reduce kernel",
             _CANNOT_MAP: "rank {rank} cannot map rank 0's shared memory (another host)",
             _NO_SEGMENT: "rank {rank} could not create the shared memory"}


def connect(rank: int, world_size: int, sum_over_ranks: Callable[[torch.Tensor], None],
            slot_bytes: int = DEFAULT_SLOT_BYTES) -> tuple[ShmAllReduce | None, str]:
    """Collective over the group that sum_over_ranks sums over (in place, e.g. a gloo all-reduce).

    Returns this rank's ShmAllReduce, or None when some rank cannot use one (no C++ kernel there, or
    it cannot map rank 0's segment: it runs on another host), with a line saying which for the log.
    """
    from tpengine.kernels.cpu.shm_allreduce import load
    shm, problem, reason = None, 0, ""
    try:
        load()
    except (RuntimeError, OSError) as error:  # no compiler, a failed build, an unwritable cache folder
        problem, reason = _NO_KERNEL, f": {error}"
    try:
        name = torch.zeros(_NAME_BYTES, dtype=torch.uint8)
        if rank == 0 and not problem:
            try:
                shm = ShmAllReduce(0, world_size, slot_bytes=slot_bytes)
                name[:len(shm.name)] = torch.frombuffer(bytearray(shm.name.encode()), dtype=torch.uint8)
            except OSError as error:  # /dev/shm full or missing
                problem, reason = _NO_SEGMENT, f": {error}"
        sum_over_ranks(name)
        segment_name = bytes(name.tolist()).rstrip(b"\0").decode()
        if rank != 0 and segment_name and not problem:
            try:
                shm = ShmAllReduce(rank, world_size, segment_name)
            except (OSError, ValueError):
                problem = _CANNOT_MAP
        problems = torch.zeros(world_size, dtype=torch.int64)
        problems[rank] = problem
        sum_over_ranks(problems)
    finally:
        if shm is not None:
            shm.unlink()  # rank 0: every rank has mapped it by now, or never will
    problems = problems.tolist()
    if not any(problems):
        return shm, f"all-reduce: shared memory ({world_size} ranks on one host)"
    if shm is not None:
        shm.close()
    why = [_PROBLEMS[p].format(rank=r) + (reason if r == rank else "") for r, p in enumerate(problems) if p]
    return None, f"all-reduce: gloo ({'; '.join(why)})"
