"""benchmarks/bench_scheduler.py --quick: decode-step bookkeeping and the prefix take-back, ours against nano-vllm's."""
import re

from tests.benchmarks import run_script


def test_bench_scheduler_quick_reports_every_size_and_the_take_back():
    out = run_script("bench_scheduler.py", "--quick", "--sizes", "8", "32").stdout
    for size in (8, 32):
        assert re.search(rf"^\| {size} \|( [\d.]+ \|){{4}} [\d.]+x \|$", out, re.MULTILINE), out
    assert re.search(r"^\| ours \(OrderedDict, O\(1\) take-back\) \| [\d.]+ \|$", out, re.MULTILINE), out
    assert re.search(r"^\| nano-vllm \(deque.remove, O\(n\)\) \| [\d.]+ \|$", out, re.MULTILINE), out
