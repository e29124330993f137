"""Multi-rank engines live as long as their owner wants, whichever thread built them, side by side with
other engines in one process, across a fork, and on a CPU whose stores the ring cannot trust."""
import concurrent.futures
import logging
import pathlib
import subprocess
import sys
import threading

import pytest

from tests.conftest import TP_MODEL, hf_greedy, random_prompts
from tests.leftovers import assert_nothing_left, snapshot
from tpengine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _prompts():
    return random_prompts(11, [5, 23], TP_MODEL["vocab_size"])


def _tokens(llm) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(_prompts(), GREEDY, use_tqdm=False)]


def test_an_engine_built_in_a_thread_outlives_the_thread(tiny_model):
    built = {}
    thread = threading.Thread(target=lambda: built.setdefault("llm", LLM(tiny_model, tensor_parallel_size=2,
                                                                         kvcache_block_size=16)))
    thread.start()
    thread.join(timeout=240)
    with built["llm"] as llm:
        assert _tokens(llm) == hf_greedy(tiny_model, _prompts(), GREEDY.max_tokens)


def test_an_engine_built_in_a_thread_pool_outlives_the_pool(tiny_model):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        llm = pool.submit(LLM, tiny_model, tensor_parallel_size=2, kvcache_block_size=16).result(timeout=240)
    with llm:
        assert _tokens(llm) == hf_greedy(tiny_model, _prompts(), GREEDY.max_tokens)


def test_engines_of_several_sizes_run_side_by_side_in_one_process(tiny_model):
    before = snapshot()
    expected = hf_greedy(tiny_model, _prompts(), GREEDY.max_tokens)
    with LLM(tiny_model, tensor_parallel_size=2, kvcache_block_size=16) as first:
        with LLM(tiny_model, tensor_parallel_size=2, kvcache_block_size=16) as second:
            with LLM(tiny_model, tensor_parallel_size=1, kvcache_block_size=16) as single:
                assert _tokens(single) == expected
                assert _tokens(second) == expected
                assert _tokens(first) == expected
            assert _tokens(first) == expected  # one engine's shutdown leaves the others running
    assert_nothing_left(before)


def test_a_model_path_may_be_a_pathlib_path(tiny_model):
    with LLM(pathlib.Path(tiny_model), tensor_parallel_size=2, kvcache_block_size=16) as llm:
        assert _tokens(llm) == hf_greedy(tiny_model, _prompts(), GREEDY.max_tokens)


FORK_SCRIPT = """
import os, sys
from tpengine import LLM, SamplingParams
params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
llm = LLM(sys.argv[1], tensor_parallel_size=2, kvcache_block_size=16)
before = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].token_ids
child = os.fork()
if child == 0:
    sys.exit(0)  # a normal exit: the child's interpreter finalizes its copy of the engine
os.waitpid(child, 0)
after = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].token_ids
print("same" if before == after else f"differs {before} {after}", flush=True)
llm.shutdown()
"""


def test_a_forked_child_never_tears_down_its_parents_engine(tiny_model):
    result = subprocess.run([sys.executable, "-c", FORK_SCRIPT, tiny_model], capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "same"


def test_a_cpu_without_x86_store_order_uses_the_broadcast_channel(tiny_model, monkeypatch, caplog):
    from tpengine.runner import multiproc_executor
    monkeypatch.setattr(multiproc_executor, "stores_are_ordered", lambda: False)
    before = snapshot()
    with caplog.at_level(logging.WARNING, logger="tpengine"):
        with LLM(tiny_model, tensor_parallel_size=2, kvcache_block_size=16) as llm:
            assert llm.executor.ring is None
            assert _tokens(llm) == hf_greedy(tiny_model, _prompts(), GREEDY.max_tokens)
    warnings = [r.getMessage() for r in caplog.records if "broadcast" in r.getMessage()]
    assert len(warnings) == 1 and "x86 store ordering" in warnings[0]
    assert_nothing_left(before)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_kv_cache_larger_than_memory_is_a_value_error_naming_both_sizes(tiny_model, tp):
    before = snapshot()
    with pytest.raises(ValueError, match=r"num_kvcache_blocks=100000000 needs a KV cache of [\d.]+ GiB per rank, "
                                         r"but [\d.]+ GiB is available"):
        LLM(tiny_model, tensor_parallel_size=tp, kvcache_block_size=16, num_kvcache_blocks=10**8)
    with pytest.raises(ValueError, match=r"kvcache_memory_gb=100000 asks for a KV cache of [\d.]+ GiB per rank, "
                                         r"but [\d.]+ GiB is available"):
        LLM(tiny_model, tensor_parallel_size=tp, kvcache_block_size=16, kvcache_memory_gb=10**5)
    assert_nothing_left(before)
