"""tools/plot_benchmarks.py --quick plots a quick bench_low_batch.py run's JSON: both PNGs are written."""
import subprocess
import sys

import pytest

from tests.tools import TOOLS, run_tool

pytest.importorskip("matplotlib", reason="the plots need the dev extra's matplotlib")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_plot_quick_draws_throughput_by_batch_and_the_step_against_the_floor(tmp_path):
    out = run_tool("plot_benchmarks.py", "--quick", "--out-dir", str(tmp_path)).stdout
    for name in ("decode-throughput-by-batch.png", "decode-step-vs-floor.png"):
        assert f"wrote {tmp_path / name}" in out, out
        data = (tmp_path / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000


def test_plot_refuses_a_json_that_is_not_bench_low_batch_s(tmp_path):
    other = tmp_path / "bench.json"
    other.write_text('{"benchmark": "bench"}')
    result = subprocess.run([sys.executable, f"{TOOLS}/plot_benchmarks.py", str(other), "--out-dir", str(tmp_path)],
                            capture_output=True, text=True)
    assert result.returncode != 0 and "not a bench_low_batch.py --json file" in result.stderr
