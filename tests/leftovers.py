"""What a test checks an engine left behind: live child processes and this process's /dev/shm segments."""
import os
import time


def segments(pid: int | None = None) -> set[str]:
    """Segments a process created (a ring's name starts with its creator's pid); other test runs share the host."""
    prefix = f"tpengine_{os.getpid() if pid is None else pid}_"
    return {name for name in os.listdir("/dev/shm") if name.startswith(prefix)}


def is_gone(pid: int) -> bool:
    """Exited or a zombie (dead, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _is_multiprocessing_helper(pid: int) -> bool:
    # the resource tracker or fork server: one per process, living as long as it, not an engine's
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"from multiprocessing." in f.read()
    except OSError:
        return False


def live_children() -> list[int]:
    """Processes whose parent is this one and that still run (multiprocessing's own helpers aside)."""
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == os.getpid() and fields[0] not in ("Z", "X") \
                    and not _is_multiprocessing_helper(int(entry)):
                children.append(int(entry))
    return children


def assert_nothing_left(limit_s: float = 10.0, since: set[str] = frozenset()) -> None:
    """No child process of this one still runs and no new segment of this process exists (waits up to limit_s)."""
    deadline = time.monotonic() + limit_s
    while (live_children() or segments() - set(since)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not live_children(), f"processes left running: {live_children()}"
    assert not segments() - set(since), f"segments left: {segments() - set(since)}"
