"""Tests of tools/: each runs a tool as a user does, in a subprocess, most in its --quick mode."""
import functools
import os

from tests.benchmarks import ROOT, import_script, run_script

TOOLS = os.path.join(ROOT, "tools")
run_tool = functools.partial(run_script, folder=TOOLS)
import_tool = functools.partial(import_script, folder=TOOLS)
