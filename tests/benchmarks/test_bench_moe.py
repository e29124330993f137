"""benchmarks/bench_moe.py --quick: grouped experts against per-token ones (the script checks their sums agree)."""
import re

from tests.benchmarks import run_script


def test_bench_moe_quick_reports_every_token_count():
    out = run_script("bench_moe.py", "--quick", "--tokens", "1", "8").stdout
    for tokens in (1, 8):
        assert re.search(rf"^\| {tokens} \| \d+ \| [\d.]+ \| [\d.]+ \| [\d.]+x \|$", out, re.MULTILINE), out
