"""benchmarks/bench_pipeline.py --quick: every configuration's row, the same tokens from each, and the bytes table."""
import json

from tests.benchmarks import run_script


def test_bench_pipeline_quick_runs_every_configuration_to_the_same_tokens(tmp_path):
    path = tmp_path / "pipeline.json"
    out = run_script("bench_pipeline.py", "--quick", "--model", str(tmp_path / "model"), "--json", str(path)).stdout
    for name in ("tp 1", "tp 2", "pp 2, one step at a time", "pp 2, 2 steps in flight"):
        assert f"| {name} |" in out
    assert "every configuration writes the same tokens: True" in out
    record = json.loads(path.read_text())
    assert record["benchmark"] == "pipeline" and record["same_tokens"]
    # a pipeline step sends the hidden states once; tensor parallelism all-reduces them twice a layer
    assert record["step_bytes_paper"]["pp"] < record["step_bytes_paper"]["tp"]
