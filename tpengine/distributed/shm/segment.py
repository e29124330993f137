"""What the step ring and the all-reduce share about a POSIX shared-memory segment: creating one under a
fresh name, mapping an existing one without the resource tracker, and telling whether a process that
maps it is still alive.

Unlinking stays with each owner, which knows when every peer has attached (``ShmRingWriter.unlink``,
``ShmAllReduce.unlink``): from then on no way the processes end can leave the segment in /dev/shm.
"""
import mmap
import os
import secrets
from multiprocessing import shared_memory

import _posixshmem

_HAVE_PROCFS = os.path.exists("/proc/self/stat")


class PeerDiedError(RuntimeError):
    """The process on the other end of a segment (the ring's writer or a reader, an all-reduce peer) is gone."""


def create_segment(size: int) -> shared_memory.SharedMemory:
    """A new segment of size bytes under a fresh name: tpengine_<pid>_<random>, so engines never collide."""
    return shared_memory.SharedMemory(f"tpengine_{os.getpid()}_{secrets.token_hex(6)}", create=True, size=size)


def attach_untracked(name: str) -> mmap.mmap:
    """Map an existing segment without registering it with the resource tracker.

    Spawned children share their parent's tracker, which keeps one entry per name:
    registering then unregistering here would erase the creator's own registration
    (losing cleanup if the creator is killed, and making its unlink print a KeyError).
    """
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    """Whether process pid still runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    if not _HAVE_PROCFS:
        return True
    # A killed child stays a zombie until its parent reaps it, and kill(pid, 0) still succeeds.
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rsplit(b")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in (b"Z", b"X")
