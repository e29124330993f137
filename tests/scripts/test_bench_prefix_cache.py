"""scripts/bench_prefix_cache.py runs end to end on CPU with a tiny workload, both caches in one run."""
import os
import re
import subprocess
import sys

from tests.scripts.test_profile_decode import SCRIPTS


def test_bench_prefix_cache_computes_fewer_prompt_tokens_with_exact_reuse():
    command = [sys.executable, os.path.join(SCRIPTS, "bench_prefix_cache.py"), "--num-seqs", "4",
               "--system-len", "300", "--max-tokens", "2", "--repeat", "1", "--num-kvcache-blocks", "16"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    computed = {name: int(n.replace(",", "")) for name, n in
                re.findall(r"\| (block-rounded|exact) [^|]*\| ([\d,]+) \|", result.stdout)}
    # 4 prompts of 350-500 tokens sharing 300, admitted in one step: the seed's cache computes all of
    # them; with exact reuse 3 wait one step while the first computes the 300, then reuse all of it
    assert computed["block-rounded"] - computed["exact"] == 3 * 300
