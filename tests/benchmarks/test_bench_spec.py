"""benchmarks/bench_spec.py --quick: the n-gram table (speculation keeps every greedy token), the verify-cost table,
the aims, the draft-model rows or the line saying why they were skipped, and its --json record; the self-draft
checkpoint it writes loads, with the target's first layers."""
import json
import re

from tests.benchmarks import import_script, run_script


def test_bench_spec_quick_reports_ngram_rows_verify_cost_and_the_aims(quick_model, tmp_path):
    path = tmp_path / "spec.json"
    out = run_script("bench_spec.py", "--quick", "--model", quick_model, "--json", str(path)).stdout
    for workload in ("repeat", "random"):
        for batch in (1, 2):
            # best-round speed-up, then the median of same-round ratios
            assert re.search(rf"^\| {workload} \| {batch} \| [\d,.]+ \| [\d,.]+ \| [\d.]+x \| [\d.]+x \| (\d+%|-) "
                             r"\| ([\d.]+|-) \| yes \|$", out, re.MULTILINE), out
    assert re.search(r"^\| 1 \| [\d.]+ \| [\d.]+ \| [\d.]+x \|$", out, re.MULTILINE), out
    for workload in ("repeat", "random"):  # whole generate() against the plain engine
        assert re.search(rf"^\| {workload} \| n-gram \| [\d.]+ \| [\d.]+ \| [\d.]+x \| [\d.]+x \|$", out,
                         re.MULTILINE), out
    assert re.search(r"^- (met|NOT met): a verify step of k \+ 1 = 5 tokens at batch 1", out, re.MULTILINE), out
    assert re.search(r"^- (met|NOT met): n-gram at batch 1 >= 2.0x plain decode", out, re.MULTILINE), out
    # the draft-model rows run once the engine takes a draft model; until then a line says why not
    assert "draft-model rows skipped: the engine refuses" in out or "draft model (a 1-layer self-draft, k = 4):" in out
    record = json.loads(path.read_text())
    assert record["benchmark"] == "bench_spec" and {"command", "machine", "load_average_before"} <= set(record)
    assert {(run["config"], run["workload"]) for run in record["generate"]} >= {("plain", "repeat"), ("n-gram", "random")}
    assert {(run["config"], run["workload"], run["batch"]) for run in record["decode"]} >= {
        ("plain", "repeat", 1), ("n-gram", "repeat", 1), ("plain", "random", 2), ("n-gram", "random", 2)}
    assert all(run["same_tokens"] and run["tokens"] == 2 * 8 for run in record["decode"])  # 2 prompts, 8 tokens each
    assert 0 <= record["draft"]["agreement"]["random"] <= 1


def test_self_draft_keeps_the_targets_first_layers_embedding_and_head(quick_model, tmp_path):
    bench_spec = import_script("bench_spec")
    draft = bench_spec.write_draft(quick_model, str(tmp_path / "draft"), 1)
    target_tensors, draft_tensors = bench_spec.load_tensors(quick_model), bench_spec.load_tensors(draft)
    assert set(draft_tensors) == {key for key in target_tensors if not key.startswith("model.layers.1.")}
    assert all(draft_tensors[key].equal(target_tensors[key]) for key in draft_tensors)
    config = bench_spec.read_config(draft)
    assert config["num_hidden_layers"] == 1 and len(config.get("layer_types", [None])) == 1
