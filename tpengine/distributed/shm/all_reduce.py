"""Sum all-reduce through one shared-memory segment, for tensor-parallel ranks on one host.

Rank 0 creates the segment, every other rank maps it, and rank 0 unlinks its name as soon as all have
(``connect``): from then on no way the processes end can leave it in /dev/shm. The C++ op
(kernels/cpu/shm_allreduce.cpp) copies this rank's tensor in, waits for the peers and sums every
rank's copy in rank order, so every rank gets the same bits, equal to ``t_0 + t_1 + ... + t_{n-1}``;
a tensor larger than a slot goes through in pieces.

``gather_to_first`` (rank 0 gets every rank's tensor, concatenated along the last dimension in rank
order) is a C++ op on the same slots and sequence numbers: each piece is a chunk as in the all-reduce,
after which rank 0 copies each rank's rows from the slots straight to their place in the output.

A wait spins for ``spin_s`` (pausing the core; yielding it when the ranks outnumber the cores this
process may run on), then sleeps on a futex in the segment that a publishing rank wakes, in slices of
``_WAIT_SLICE_S`` after each of which the op returns and this side checks that the peers it waits for
are alive before it resumes the wait.

Segment layout, native uint64 words in 64-byte lines::

    line 0                magic, world_size, slot_bytes, wake (futex: low 32 bits), sleepers
    line 1 + r            rank r: ready_seq, chunk_bytes (two: by seq parity), pid
    control_bytes + ...   rank r's two slots of slot_bytes each, rank after rank
"""
from __future__ import annotations

import os
from collections.abc import Callable
from multiprocessing import shared_memory, util

import torch

from tpengine.distributed.shm.segment import PeerDiedError, attach_untracked, create_segment, pid_alive

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # float64: the sampler's few numbers
DEFAULT_SLOT_BYTES = 1 << 20  # a decode step's tensor fits whole; a prefill pass's goes in a few pieces

_MAGIC = int.from_bytes(b"tpeallr2", "little")  # also versions the layout
_LINE_WORDS = 8
_NAME_BYTES = 128
_MAGIC_WORD, _WORLD_SIZE_WORD, _SLOT_BYTES_WORD = 0, 1, 2
SLEEPERS_WORD = 4  # line 0: ranks asleep in the C++ op's futex wait (word 3 is the futex)
_READY_SEQ, _PID = 0, 3  # words of a rank's line; 1 and 2 are the C++ op's chunk sizes
# spinning before a wait sleeps: enough for ranks that run in step; longer spins hold a core that the
# awaited rank may need when other processes crowd the cores (2 ms: tp=2 at half the speed under load)
DEFAULT_SPIN_S = 200e-6
_WAIT_SLICE_S = 0.05  # the longest an op sleeps before this side checks that the peers are alive


def _control_words(world_size: int) -> int:
    return _LINE_WORDS * (1 + world_size)


def _segment_bytes(world_size: int, slot_bytes: int) -> int:
    return 8 * _control_words(world_size) + world_size * 2 * slot_bytes


class ShmAllReduce:
    """This rank's end of the segment: rank 0 creates it (``name=None``), the others attach by name."""

    def __init__(self, rank: int, world_size: int, name: str | None = None, slot_bytes: int = DEFAULT_SLOT_BYTES,
                 spin_s: float = DEFAULT_SPIN_S):
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
        self._all_reduce_op = torch.ops.tpengine_shm.all_reduce
        self._gather_op = torch.ops.tpengine_shm.gather
        self.spin_s = spin_s
        # more ranks than cores to run them: a spinning rank would hold up the one it waits for
        self._yield_cpu = world_size > len(os.sched_getaffinity(0))
        self._segment: shared_memory.SharedMemory | None = None
        if name is None:
            self._segment = create_segment(_segment_bytes(world_size, slot_bytes))
            # unlinks on close(), garbage collection or exit if connect() never got to it
            self._unlink_finalizer = util.Finalize(self, _unlink, (self._segment,), exitpriority=0)
            name = self._segment.name
            self._segment.close()  # its own mapping; the tensors below view this rank's mapping, as on the others
        self.name, self._mapping = name, attach_untracked(name)
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
        data = tensor if tensor.is_contiguous() else tensor.contiguous()
        flat = data.view(-1)
        chunk_elements = self.slot_bytes // flat.element_size()
        op, control, slots, rank, first_seq = self._all_reduce_op, self._control, self._slots, self.rank, self._seq
        self._run(lambda start, resumed, spin_s: op(flat, control, slots, rank, first_seq, start, resumed, spin_s,
                                                    _WAIT_SLICE_S, self._yield_cpu),
                  -(-flat.numel() // chunk_elements))
        if data is not tensor:
            tensor.copy_(data)

    def gather_to_first(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Every rank's tensor concatenated along the last dimension in rank order, on rank 0 (bit for
        bit); None on the other ranks. Every rank calls it with a tensor of the same shape and dtype.

        PeerDiedError when a rank it waits for has died; the segment is then unusable.
        """
        data = tensor if tensor.is_contiguous() else tensor.contiguous()
        shape = data.shape if data.dim() else torch.Size([1])
        flat = data.view(-1).view(torch.uint8)  # bytes: copied, never added, so every bit survives
        row_bytes = max(1, shape[-1] * data.element_size())
        out = (torch.empty((*shape[:-1], self.world_size * shape[-1]), dtype=data.dtype) if self.rank == 0
               else torch.empty(0, dtype=data.dtype))
        out_bytes = out.view(-1).view(torch.uint8)
        op, control, slots, rank, first_seq = self._gather_op, self._control, self._slots, self.rank, self._seq
        self._run(lambda start, resumed, spin_s: op(flat, out_bytes, control, slots, rank, first_seq, start, resumed,
                                                    spin_s, _WAIT_SLICE_S, self._yield_cpu, row_bytes),
                  max(1, -(-flat.numel() // self.slot_bytes)))
        return out if self.rank == 0 else None

    def _run(self, op: Callable[[int, bool, float], int], num_chunks: int) -> None:
        """Drive op (start chunk, whether this rank already published it, spin seconds -> chunks done)
        until all num_chunks are done, checking the peers whenever it returns early."""
        if self._broken:
            raise RuntimeError(f"shm all-reduce {self.name}: an earlier all-reduce failed midway")
        try:
            done = op(0, False, self.spin_s)
            while done < num_chunks:
                self._check_peers(self._seq + done + 1)
                done = op(done, True, 0.0)
        except BaseException:
            self._broken = True  # the ranks' chunk counts may now disagree
            raise
        self._seq += num_chunks

    def _check_peers(self, seq: int) -> None:
        """Raise if the wait for seq cannot end: this side was aborted, or a rank that has not published
        it is dead."""
        words = self._words
        lagging = [r for r in range(self.world_size) if words[self._line(r) + _READY_SEQ] < seq]
        if self._aborted:
            raise RuntimeError(f"shm all-reduce {self.name} was aborted while waiting for ranks {lagging}")
        for rank in lagging:
            pid = words[self._line(rank) + _PID]
            if not pid_alive(pid):
                raise PeerDiedError(f"tensor-parallel rank {rank} (pid {pid}) died during an all-reduce")

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
