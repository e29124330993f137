"""scripts/profile_decode.py runs end to end on CPU (a tiny model, host clock): the CUDA run uses the same code."""
import os
import subprocess
import sys

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts")


def test_profile_reports_step_times_replays_and_bandwidths_on_cpu(tiny_model):
    command = [sys.executable, os.path.join(SCRIPTS, "profile_decode.py"), "--device", "cpu", "--model", tiny_model,
               "--batch-size", "3", "--context-len", "20", "--steps", "3", "--warm-up-steps", "1",
               "--attention-repeats", "2", "--copy-mib", "4"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "3 decode steps measured after 1 warm-up steps" in out
    assert "CUDA-graph replays: 0 in 4 decode steps (graphs off)" in out  # the first token comes from prefill
    for row in ("| host: llm.step() wall time |", "| CPU: decode forward (host clock) |",
                "| device-to-device copy, 4 MiB", "| decode attention, one layer:", "| decode forward:"):
        assert row in out, out
