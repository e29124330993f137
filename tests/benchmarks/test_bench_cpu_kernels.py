"""benchmarks/bench_cpu_kernels.py --quick: every section times its fast path against what it replaced."""
import re

from tests.benchmarks import run_script


def data_rows(section: str) -> int:
    return len(re.findall(r"^\| [\d.]+ \|", section, re.MULTILINE))


def test_bench_cpu_kernels_quick_reports_every_section():
    out = run_script("bench_cpu_kernels.py", "--quick").stdout
    sections = {text.split(":")[0]: text for text in out.split("\n## ")[1:]}
    assert data_rows(sections["Paged decode attention"]) == 2, out  # block sizes 16 and 256
    assert data_rows(sections["Linear layers"]) == 2, out  # rows 1 and 4
    bf16 = sections["bfloat16 linears"]
    assert data_rows(bf16) == 2 or "this CPU has no AVX512-BF16" in bf16, out
    assert data_rows(sections["Sampling one token per row"]) == 1, out
    assert data_rows(sections["Rotary on q and k, eager"]) == 2, out
