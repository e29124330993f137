"""benchmarks/bench.py runs end to end on CPU: --quick writes its tiny model, warms up, and times both engines."""
import json
import shutil

from tests.benchmarks import run_script
from tpengine.bench.models import write_model


def test_bench_quick_writes_its_model_and_reports_both_engines(tmp_path):
    result = run_script("bench.py", "--quick", "--json", str(tmp_path / "bench.json"))
    assert "wrote a random-weight Qwen3" in result.stderr
    assert "[tpengine] timed generate starts" in result.stderr
    out = result.stdout
    assert "| model | random-weight Qwen3: hidden 64, 2 layers," in out, out
    assert "| workload | 6 seqs, input 4..24" in out, out
    assert "| tpengine (tp=1, cpu) | **" in out
    assert "| transformers generate, batch 2 |" in out
    assert "| tpengine / transformers | **" in out
    record = json.loads((tmp_path / "bench.json").read_text())
    assert {"command", "date", "revision", "machine", "load_average_before", "load_average_after"} <= set(record)
    assert set(record["seconds"]) == {"tpengine mixed", "transformers batch 2"}
    assert record["workload"]["num_seqs"] == 6 and record["model"]["hidden_size"] == 64


def test_bench_reuses_a_model_already_in_model_dir(tiny_model, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    before = {f.name: f.stat().st_mtime_ns for f in folder.iterdir()}
    assert write_model("cpu", str(folder)) == str(folder)
    assert {f.name: f.stat().st_mtime_ns for f in folder.iterdir()} == before  # nothing written
