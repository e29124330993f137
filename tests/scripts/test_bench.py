"""scripts/bench.py runs end to end on CPU with a tiny workload, warm-up and baseline included."""
import os
import shutil
import subprocess
import sys

from tests.scripts.test_profile_decode import SCRIPTS


def test_bench_reports_both_engines_on_a_tiny_workload(tiny_model, tmp_path):
    command = [sys.executable, os.path.join(SCRIPTS, "bench.py"), "--model", tiny_model, "--num-seqs", "5",
               "--min-input-len", "3", "--max-input-len", "20", "--min-output-len", "2", "--max-output-len", "6",
               "--hf-batch-size", "2", "--max-num-seqs", "4"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[tpengine] timed generate starts" in result.stderr
    assert "| tpengine (tp=1, cpu) | **" in result.stdout
    assert "| transformers generate, batch 2 |" in result.stdout
    assert "| tpengine / transformers | **" in result.stdout


def test_bench_reuses_a_model_already_in_model_dir(tiny_model, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    sys.path.insert(0, SCRIPTS)
    try:
        import bench
    finally:
        sys.path.remove(SCRIPTS)
    before = {f.name: f.stat().st_mtime_ns for f in folder.iterdir()}
    assert bench.write_model("cpu", str(folder)) == str(folder)
    assert {f.name: f.stat().st_mtime_ns for f in folder.iterdir()} == before  # nothing written
