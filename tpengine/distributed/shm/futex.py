"""Linux futexes on words of a shared mapping, from Python (ctypes: no compiler needed).

A waiter sleeps until the 32-bit word at an address changes from a value it saw, a waker calls
``wake`` after changing the word: the kernel orders the two, so no wake-up is lost. Processes that
map the same shared memory wait on and wake the same futex. ``available()`` is False where the
syscall number is unknown; callers then poll.
"""
import ctypes
import os
import platform

_SYSCALL_NUMBERS = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98, "riscv64": 98, "i386": 240, "i686": 240}
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_WAKE_ALL = 0x7FFFFFFF

_number = _SYSCALL_NUMBERS.get(platform.machine().lower()) if os.uname().sysname == "Linux" else None
_syscall = ctypes.CDLL(None, use_errno=True).syscall if _number is not None else None  # releases the GIL


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def available() -> bool:
    return _syscall is not None


def address_of(buffer, offset: int = 0) -> int:
    """The address of byte offset of a writable buffer (an mmap, a memoryview of one); valid while the
    mapping is. Holds no export of the buffer, so the mapping can still be closed."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer)) + offset


def wait(address: int, seen: int, timeout_s: float) -> None:
    """Sleep while the 32-bit word at address still holds seen (its low 32 bits), at most timeout_s;
    returns at once if it no longer does. Spurious returns happen: the caller checks its condition."""
    timeout = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    _syscall(_number, ctypes.c_void_p(address), _FUTEX_WAIT, ctypes.c_uint32(seen & 0xFFFFFFFF),
             ctypes.byref(timeout), None, 0)


def wake(address: int) -> None:
    """Wake every process sleeping on the word at address (after changing it)."""
    _syscall(_number, ctypes.c_void_p(address), _FUTEX_WAKE, _WAKE_ALL, None, None, 0)
