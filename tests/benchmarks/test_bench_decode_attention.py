"""benchmarks/bench_decode_attention.py --quick: the kernel against a baseline built beside it (here its own source:
the clone's history is not needed), every case in both dtypes, then inside a tiny engine."""
import os

from tests.benchmarks import run_script

KERNEL = os.path.join(os.path.dirname(__file__), "..", "..", "kernels", "cpu", "paged_decode_attention.cpp")


def test_bench_decode_attention_quick_times_both_kernels_on_every_case():
    out = run_script("bench_decode_attention.py", "--quick", "--baseline-source", KERNEL).stdout
    rows = [line for line in out.splitlines() if line.startswith("| batch ")]
    assert len(rows) == 4 + 2, out  # 2 cases x 2 dtypes, then the 2 cases inside an engine
    for row in rows[:4]:
        difference = float(row.rstrip(" |").split("|")[-1])
        assert difference == 0.0, row  # the same kernel both sides: the same outputs
