"""benchmarks/bench_allreduce.py --quick: the shared-memory all-reduce and gather against gloo's, at tp=2."""
import re

from tests.benchmarks import run_script


def test_bench_allreduce_quick_times_shared_memory_against_gloo_at_every_size():
    out = run_script("bench_allreduce.py", "--quick").stdout
    for collective, size in (("all-reduce", "4 KB"), ("all-reduce", "64 KB"), ("gather to rank 0", "16 KB")):
        assert re.search(rf"^\| {collective} \| {size} \| [\d,.]+ \| [\d,.]+ \| [\d.]+x \|$", out, re.MULTILINE), out
