"""benchmarks/bench_data_parallel.py --quick runs end to end on CPU: one replica, then two behind vllm-router with each
routing policy."""
import re

import pytest

from tests.benchmarks import run_script
from tpengine.entrypoints.data_parallel import router_available


@pytest.mark.skipif(not router_available(), reason="vllm-router has wheels for Linux only: not installable here")
def test_bench_data_parallel_cache_aware_computes_no_more_prompt_tokens_than_round_robin():
    out = run_script("bench_data_parallel.py", "--quick", "--num-cores", "2").stdout
    rows = {setup.strip(): (int(prompt.replace(",", "")), int(computed.replace(",", "")))
            for setup, prompt, computed in re.findall(r"^\| ([^|]+) \| [\d.]+ \| [\d,]+ \| ([\d,]+) \| ([\d,]+) \|", out,
                                                      re.MULTILINE)}
    assert set(rows) == {"1 replica x 2 threads", "2 replicas x 1 thread, cache_aware",
                         "2 replicas x 1 thread, round_robin"}, out
    assert len({prompt for prompt, _ in rows.values()}) == 1, out  # every setup ran the same prompts
    # cache_aware keeps each prefix on one replica; round_robin computes it on both
    assert rows["2 replicas x 1 thread, cache_aware"][1] <= rows["2 replicas x 1 thread, round_robin"][1], out
