"""tools/gpu_check.sh parses, and without CUDA it stops at its environment check with a reason."""
import os
import subprocess
import sys

import pytest
import torch

from tests.tools import TOOLS

GPU_CHECK = os.path.join(TOOLS, "gpu_check.sh")


def test_gpu_check_is_valid_bash():
    result = subprocess.run(["bash", "-n", GPU_CHECK], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA stop")
def test_gpu_check_without_cuda_stops_after_the_environment_naming_why(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "WHEELS": str(tmp_path),  # no wheels: this venv has all
           "PYTHON": sys.executable}
    result = subprocess.run(["bash", GPU_CHECK], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 1
    out = tmp_path / "out"
    assert "no CUDA device" in (out / "summary.txt").read_text()
    assert "missing: nothing" in (out / "env.txt").read_text() and not (out / "tests.log").exists()
