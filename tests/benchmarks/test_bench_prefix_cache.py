"""benchmarks/bench_prefix_cache.py --quick runs end to end on CPU, both caches in one run."""
import re

from tests.benchmarks import run_script


def test_bench_prefix_cache_computes_fewer_prompt_tokens_with_exact_reuse():
    out = run_script("bench_prefix_cache.py", "--quick", "--num-seqs", "4", "--system-len", "300",
                     "--num-kvcache-blocks", "16").stdout
    computed = {name: int(n.replace(",", ""))
                for name, n in re.findall(r"\| (block-rounded|exact) [^|]*\| ([\d,]+) \|", out)}
    # 4 prompts of 350-500 tokens sharing 300, admitted in one step: the seed's cache computes all of
    # them; with exact reuse 3 wait one step while the first computes the 300, then reuse all of it
    assert computed["block-rounded"] - computed["exact"] == 3 * 300, out
