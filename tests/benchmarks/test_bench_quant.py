"""benchmarks/bench_quant.py --quick: every format's row (weights, decode, throughput, agreement with float32) and the
aims checked against bfloat16, and its --json record."""
import json
import re

from tests.benchmarks import run_script


def test_bench_quant_quick_reports_every_format_against_bfloat16_and_float32(quick_model, tmp_path):
    record = tmp_path / "quant.json"
    out = run_script("bench_quant.py", "--quick", "--model", quick_model, "--json", str(record)).stdout
    for fmt in ("float32", "bfloat16", "int8", "int4"):
        assert re.search(rf"^\| {fmt} \([\w ,]+\) \| [\d,]+ \([\d.]+x\) \| -?[\d,]+ \| [\d,.]+ \([\d.]+x\) \| "
                         rf"[\d,.]+ \([\d.]+x\) \| [\d,.]+ \([\d.]+x\) \| \d+%, \d+% \|$", out, re.MULTILINE), out
    assert "| float32 (float32) | " in out and "100%, 100% |" in out, out  # float32 agrees with itself
    assert re.search(r"^- (met|NOT met): int4 resident weights <= 0.3x bfloat16", out, re.MULTILINE), out
    models = json.loads(record.read_text())["models"]
    assert set(next(iter(models.values()))["tpengine"]) == {"float32", "bfloat16", "int8", "int4"}


def test_bench_quant_eager_too_measures_each_format_with_and_without_replayed_decode(quick_model):
    out = run_script("bench_quant.py", "--quick", "--model", quick_model, "--formats", "int8", "--eager-too",
                     "--throughput-seqs", "0", "--agreement-prompts", "0").stdout
    assert re.search(r"^\| int8 \(\w+\) \| ", out, re.MULTILINE), out
    assert re.search(r"^\| int8 eager \(\w+\) \| ", out, re.MULTILINE), out
