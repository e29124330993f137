"""scripts/bench_serve.py side by side runs without vLLM: it says so and measures tpengine alone."""
import os
import subprocess
import sys

from tests.scripts.test_profile_decode import SCRIPTS


def test_side_by_side_without_vllm_measures_tpengine_alone(tied_model, tmp_path):
    command = [sys.executable, os.path.join(SCRIPTS, "bench_serve.py"), "--model", tied_model,
               "--vllm-bin", str(tmp_path), "--num-prompts", "3", "--min-input-len", "4", "--max-input-len", "12",
               "--min-output-len", "3", "--max-output-len", "6", "--repeat", "2", "--temperature", "0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"no vllm-cli in {tmp_path}: measuring tpengine alone" in result.stdout
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[:2] for row in rows[1:]] == [["| 1", "tpengine"], ["| 2", "tpengine"],
                                                          ["| median", "tpengine"]]
