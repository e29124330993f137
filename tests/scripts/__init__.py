"""Tests of scripts/: each runs a script as a user does, in a subprocess, most in its --quick mode."""
import importlib
import os
import subprocess
import sys

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts")


def run_script(name: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """scripts/name with args, in this interpreter; fails the test, showing stderr's tail, unless it exits 0."""
    result = subprocess.run([sys.executable, os.path.join(SCRIPTS, name), *args], capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def import_script(name: str):
    """scripts/name.py as a module: scripts/ is not a package, its modules import each other by bare name."""
    sys.path.insert(0, SCRIPTS)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(SCRIPTS)
