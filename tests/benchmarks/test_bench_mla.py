"""benchmarks/bench_mla.py: the KV-cache formulas at the published configurations, and --quick without llama.cpp (the
engine's allocated KV bytes per token equal to the formula for every model, tpengine's decode rows, the skip said,
and its --json record)."""
import json
import re

from tests.benchmarks import import_script, run_script


def test_kv_bytes_per_token_formulas_at_the_published_configurations():
    bench = import_script("bench_mla")
    models = bench.KV_MODELS
    assert bench.formula_bytes(models["DeepSeek-V2-Lite"], 1) == 27 * 576 * 2 == 31104
    assert bench.formula_bytes(models["DeepSeek-V2-Lite"], 8) == 31104  # the latent is whole on every rank
    assert bench.formula_bytes(models["DeepSeek-V3"], 1) == 61 * 576 * 2
    assert bench.formula_bytes(models["Qwen3-30B-A3B"], 1) == 48 * 2 * 4 * 128 * 2 == 98304
    assert bench.formula_bytes(models["Qwen3-30B-A3B"], 2) == 98304 // 2
    assert bench.formula_bytes(models["Qwen3-30B-A3B"], 8) == 98304 // 4  # 4 KV heads: one replicated a rank
    assert bench.formula_bytes(models["DeepSeek-V2-Lite"], 1, dtype_bytes=1, num_layers=2) == 2 * 576


def test_bench_mla_quick_measures_every_models_kv_bytes_and_decodes_without_llamacpp(tmp_path):
    record = tmp_path / "mla.json"
    out = run_script("bench_mla.py", "--quick", "--json", str(record)).stdout
    assert "CPU flags: " in out, out
    for name, formula in (("DeepSeek-V2-Lite", "2,304"), ("DeepSeek-V3", "2,304"), ("Qwen3-30B-A3B", "4,096"),
                          ("Qwen3-235B-A22B", "4,096")):
        # the engine's allocation equals the formula at 2 layers
        assert re.search(rf"^\| {name} \(.*\) \| (MLA|GQA) \| .* \| 2 \| {formula} B / {formula} B \| ", out,
                         re.MULTILINE), out
    assert "differs" not in out, out
    for batch in (1, 2):
        for fmt in ("bfloat16", "int8"):
            assert re.search(rf"^\| {batch} \| {fmt} \| [\d,.]+ \([\d,.]+\) \| \(skipped\) \| \| \|$", out,
                             re.MULTILINE), out
    assert "llama.cpp skipped: --quick or --no-llamacpp" in out, out
    figures = json.loads(record.read_text())
    assert set(figures["kv"]) == {"DeepSeek-V2-Lite", "DeepSeek-V3", "Qwen3-30B-A3B", "Qwen3-235B-A22B"}
    assert figures["kv"]["DeepSeek-V2-Lite"]["measured"]["1"]["bytes_per_token"] == 2 * 576 * 2
    assert set(figures["decode"]["tpengine"]) == {"bfloat16", "int8"} and figures["decode"]["llama_cpp"] == {}
    assert figures["cpu_flags"]
