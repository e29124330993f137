"""benchmarks/bench_cpu_dtype.py --quick: every dtype's decode, and bfloat16's agreement with transformers."""
import re

from tests.benchmarks import run_script


def test_bench_cpu_dtype_quick_reports_every_dtype_and_the_agreement_with_transformers(quick_model):
    out = run_script("bench_cpu_dtype.py", "--quick", "--model", quick_model, "--batch-sizes", "1", "2",
                     "--agreement", "2").stdout
    dtype_rows = re.findall(r"^\| [12] \| .*x \| .*x \| .*x \|$", out, re.MULTILINE)
    assert len(dtype_rows) == 2, out  # batches 1 and 2, each with float32, bfloat16 and float16
    for compared in ("tpengine bfloat16 vs transformers bfloat16", "tpengine bfloat16 vs transformers float32"):
        assert re.search(rf"\| {compared} \| \d/2 prompts match all 4 tokens", out), out
