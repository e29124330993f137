"""benchmarks/bench_scoring.py --quick runs end to end: the prompt-logprob table (plain prefill, with the cache,
without it; the cache computes fewer tokens) and the batch-invariance table, and --json."""
import json

from tests.benchmarks import run_script


def test_scoring_bench_reports_prompt_logprob_and_batch_invariance_costs(quick_model, tmp_path):
    path = tmp_path / "scoring.json"
    out = run_script("bench_scoring.py", "--quick", "--model", quick_model, "--json", str(path)).stdout
    for row in ("| plain prefill |", "| prompt logprobs, cache on |", "| prompt logprobs, cache off |",
                "| decode step, batch 1 (ms) |", "| decode step, batch 4 (ms) |", "| prefill (s) |"):
        assert row in out, out
    record = json.loads(path.read_text())
    assert record["benchmark"] == "bench_scoring"
    tokens = {name: figures["tokens"][0] for name, figures in record["prompt_logprobs"].items()}
    assert tokens["prompt logprobs, cache on"] < tokens["prompt logprobs, cache off"]
    assert all(ms > 0 for figures in record["batch_invariance"].values() for ms in figures["decode_ms_1"])
