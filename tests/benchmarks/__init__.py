"""Tests of benchmarks/ (and, through tests/tools, of tools/): each runs a script as a user does, in a subprocess,
most in its --quick mode."""
import importlib
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCHMARKS = os.path.join(ROOT, "benchmarks")


def run_script(name: str, *args: str, timeout: float = 240, folder: str = BENCHMARKS) -> subprocess.CompletedProcess:
    """folder/name with args, in this interpreter; fails the test, showing stderr's tail, unless it exits 0."""
    result = subprocess.run([sys.executable, os.path.join(folder, name), *args], capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def import_script(name: str, folder: str = BENCHMARKS):
    """folder/name.py as a module: a script's folder is not a package; a benchmark imports its baselines
    (nano_baseline.py, decode_baselines.py, ...) from its own folder, as Python does for a script run by path."""
    sys.path.insert(0, folder)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(folder)
