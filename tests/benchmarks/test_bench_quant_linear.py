"""benchmarks/bench_quant_linear.py --quick: the quantized linear against a baseline built beside it (here its own source:
the clone's history is not needed), for every format, activation and row count."""
import os

import pytest

from tests.benchmarks import run_script
from tpengine.kernels.cpu.quant_linear import available

pytestmark = pytest.mark.skipif(not available(), reason="no C++ compiler to build the quantized linear")

KERNEL = os.path.join(os.path.dirname(__file__), "..", "..", "kernels", "cpu", "quant_linear.cpp")


def test_bench_quant_linear_quick_times_both_kernels_on_every_case():
    out = run_script("bench_quant_linear.py", "--quick", "--baseline-source", KERNEL).stdout
    rows = [line for line in out.splitlines() if line.startswith("| int")]
    assert len(rows) == 2 * 2 * 2, out  # 2 formats x 2 activations x 2 row counts
    for row in rows:
        difference = float(row.rstrip(" |").split("|")[-1])
        assert difference == 0.0, row  # the same kernel both sides: the same outputs
