"""benchmarks/bench_gguf.py --quick without llama.cpp: GGUF files written with gguf's own writer, tpengine's row per
file (decode at two batches, prefill, resident weights against the file's tensor bytes), the weights aim checked,
the skip said, and its --json record."""
import json
import re

from tests.benchmarks import run_script


def test_bench_gguf_quick_without_llamacpp_runs_tpengine_on_each_file_and_says_llamacpp_was_skipped(tmp_path):
    record = tmp_path / "gguf.json"
    out = run_script("bench_gguf.py", "--quick", "--llamacpp", str(tmp_path / "no-llama.cpp"),
                     "--json", str(record)).stdout
    assert "llama.cpp skipped: no llama-bench" in out, out
    for name in ("Q8_0", "Q4_0"):
        row = rf"^\| {name} \| tpengine \| [\d,.]+ \| [\d,.]+ \| [\d,.]+ \| [\d,]+ \([\d.]+x\) \|$"
        assert re.search(row, out, re.MULTILINE), out
        assert re.search(rf"^- {name}: (met|NOT met): resident weights <= 1.1x the file's tensor bytes", out,
                         re.MULTILINE), out
    assert "| llama.cpp |" not in out, out
    model = json.loads(record.read_text())["models"]["quick"]
    assert set(model["tpengine"]) == {"Q8_0", "Q4_0"} and model["llama_cpp"] == {}
    assert all(file["tensor_bytes"] > 0 for file in model["files"].values())
