"""benchmarks/bench_prefill_attention.py --quick: SDPA and the kernel timed on every case, on one thread and on all,
with the same outputs."""
import pytest
import torch

from tests.benchmarks import run_script
from tpengine.kernels.cpu.build import has_compiler


@pytest.mark.skipif(not has_compiler(), reason="the kernel needs a C++ compiler")
def test_bench_prefill_attention_quick_times_both_on_every_case():
    out = run_script("bench_prefill_attention.py", "--quick").stdout
    rows = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 2 * len({1, torch.get_num_threads()}), out
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert float(cells[2].replace(",", "")) > 0 and float(cells[3].replace(",", "")) > 0, row
        assert float(cells[5]) < 1e-4, row  # the same attention
