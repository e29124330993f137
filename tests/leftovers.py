"""What a test checks an engine left behind: live child processes and this process's /dev/shm segments."""
import atexit
import os
import shutil
import tempfile
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


def snapshot() -> tuple[set[str], set[int]]:
    """This process's segments and live children now: a server or helper a fixture keeps may already run."""
    return segments(), set(live_children())


def assert_nothing_left(since: tuple[set[str], set[int]] = (set(), set()), limit_s: float = 10.0) -> None:
    """No child process started and no segment created since the snapshot is still there (waits up to limit_s)."""
    old_segments, old_children = since

    def left() -> tuple[set[str], set[int]]:
        return segments() - old_segments, set(live_children()) - old_children

    deadline = time.monotonic() + limit_s
    while any(left()) and time.monotonic() < deadline:
        time.sleep(0.1)
    new_segments, new_children = left()
    assert not new_children, f"processes left running: {sorted(new_children)}"
    assert not new_segments, f"segments left: {sorted(new_segments)}"


def session_folder(prefix: str) -> str:
    """A temporary folder for this test process's checkpoints, removed when the process exits."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path
