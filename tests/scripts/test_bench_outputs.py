"""scripts/bench_outputs.py runs end to end on a tiny workload and reports every case against its baseline."""
import os
import subprocess
import sys

from tests.scripts.test_profile_decode import SCRIPTS


def test_bench_outputs_reports_every_case_on_a_tiny_workload():
    command = [sys.executable, os.path.join(SCRIPTS, "bench_outputs.py"), "--seqs", "6", "--steps", "4",
               "--warmup", "2"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    for case in ("| neither (generate()) |", "| streamed |", "| stop strings |", "| streamed + stop strings |"):
        assert case in result.stdout
