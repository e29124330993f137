"""benchmarks/bench_serve.py --quick: `tpengine serve` under streamed load against offline LLM.generate; side by side
without vLLM it says so and measures tpengine alone."""
import re

import pytest

from tests.benchmarks import run_script

pytest.importorskip("fastapi", reason="the server needs the serve extra")
pytest.importorskip("uvicorn", reason="the server needs the serve extra")


def test_bench_serve_quick_reports_the_server_against_offline_and_stops_cleanly(quick_model):
    out = run_script("bench_serve.py", "--quick", "--model", quick_model).stdout
    assert re.search(r"^\| output tok/s \| [\d,.]+ \| [\d,.]+ \|$", out, re.MULTILINE), out  # server, offline
    for measure in ("TTFT", "inter-token latency", "end-to-end latency"):
        assert re.search(rf"^\| {measure} p50 / p99 \| [\d,.]+ / [\d,.]+ ms \|", out, re.MULTILINE), out
    assert "server exit status after SIGTERM: 0" in out


def test_side_by_side_without_vllm_measures_tpengine_alone(quick_model, tmp_path):
    out = run_script("bench_serve.py", "--quick", "--model", quick_model, "--vllm-bin", str(tmp_path),
                     "--num-prompts", "3", "--repeat", "2", "--temperature", "0").stdout
    assert f"no vllm-cli in {tmp_path}: measuring tpengine alone" in out
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[:2] for row in rows[1:]] == [["| 1", "tpengine"], ["| 2", "tpengine"],
                                                          ["| median", "tpengine"]]
