"""benchmarks/bench_mixed.py --quick: requests arriving over time, under both scheduling policies."""
import re

from tests.benchmarks import run_script


def test_bench_mixed_quick_reports_both_policies(quick_model):
    out = run_script("bench_mixed.py", "--quick", "--model", quick_model).stdout
    for policy in ("mixed", "prefill_first"):
        assert re.search(rf"^\| {policy} \| \d+ \| \d+ \| [\d.]+ \| [\d.]+ \|$", out, re.MULTILINE), out
