"""benchmarks/bench_structured.py --quick: rank 0's cost per constrained row against the same step unconstrained,
on both vocabularies, and the first token of a new schema against a cached one."""
import re

from tests.benchmarks import run_script


def test_bench_structured_quick_reports_both_vocabularies_and_the_first_token():
    out = run_script("bench_structured.py", "--quick", "--sizes", "8").stdout
    for vocabulary in ("tiny byte tokenizer", "synthetic byte strings"):
        assert re.search(rf"^\| {vocabulary} \| [\d,]+ \| 8 \| [\d,]+ \| [\d,]+ \| -?[\d.]+ \|$", out, re.MULTILINE), out
    assert re.search(r"new schema [\d.]+ ms, cached schema [\d.]+ ms", out), out
