"""What every benchmark records beside its figures (command, machine, date, revision, load average), and --json PATH.

docs/benchmarks.md gives each table its command, machine, date, revision and load average; a benchmark run with
--json PATH writes the same record and its figures as one JSON object, which tools/plot_benchmarks.py reads.
Imports nothing heavy (machine_line imports torch when called), so benchmarks that never touch torch stay light.
"""
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout, if it is one


def load_average() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "n/a"


def git_revision() -> str:
    try:
        rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "n/a"
    return (rev + (" (uncommitted changes)" if dirty else "")) if rev else "n/a"


def machine_line(device: str, num_threads: int) -> str:
    """The processor or GPU, its cores and torch's threads, and the versions that decide the figures."""
    import torch
    import transformers
    if device == "cuda":
        name = torch.cuda.get_device_name()
    else:
        name = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
        except (OSError, StopIteration):
            pass
    return (f"{name}; os.cpu_count()={os.cpu_count()}, torch threads={num_threads}; "
            f"torch {torch.__version__}, transformers {transformers.__version__}, python {platform.python_version()}")


def command_line(argv=None, program: str | None = None) -> str:
    """The command as run: program (default: the script's path relative to the current folder) and argv."""
    return shlex.join([program or os.path.relpath(sys.argv[0]), *(sys.argv[1:] if argv is None else argv)])


def add_json_flag(parser) -> None:
    parser.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON "
                                                       "(tools/plot_benchmarks.py plots them)")


class Record:
    """A run's record, started before the timing (date, load before) and written after it (load after)."""

    def __init__(self, benchmark: str, argv=None, machine: str = "", program: str | None = None):
        self.fields = dict(benchmark=benchmark, command=command_line(argv, program),
                           date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                           revision=git_revision(), machine=machine, load_average_before=load_average())

    def write(self, path: str | None, **figures) -> None:
        if not path:
            return
        record = dict(self.fields, load_average_after=load_average(), **figures)
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        with open(path, "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
        print(f"wrote {path}", file=sys.stderr)
