"""The shared-memory all-reduce between real rank processes: bitwise the rank-order sum on every rank,
any size through small slots, a dead peer raised within seconds, nothing left in /dev/shm."""
import logging
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.multiprocessing as mp

from tests.conftest import TP_MODEL, hf_greedy, random_prompts
from tests.distributed.shm.ranks import check_gathers, check_sums, check_wakes, segments
from tpengine import LLM, SamplingParams
from tpengine.distributed.parallel_state import find_free_port
from tpengine.distributed.shm.segment import PeerDiedError
from tpengine.errors import WorkerFailedError
from tpengine.kernels.cpu.build import has_compiler

needs_compiler = pytest.mark.skipif(not has_compiler(), reason="no C++ compiler here")

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@needs_compiler
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_rank_gets_the_rank_order_sum_bit_for_bit_at_every_size(world_size, tmp_path):
    names_file = tmp_path / "segments"
    mp.spawn(check_sums, args=(world_size, find_free_port(), str(names_file)), nprocs=world_size)
    names = names_file.read_text().split()
    assert len(names) == 2 and not set(names) & segments()


@needs_compiler
@pytest.mark.parametrize("world_size", [2, 3])
def test_rank0_gathers_every_ranks_tensor_bit_for_bit_through_the_segment(world_size):
    ranks = mp.spawn(check_gathers, args=(world_size, find_free_port()), nprocs=world_size, join=False)
    while not ranks.join():
        pass
    # segments are named after the pid that made them: another test run's can come and go meanwhile
    made_here = {f"tpengine_{process.pid}_" for process in ranks.processes}
    assert not {name for name in segments() if name[:name.rindex("_") + 1] in made_here}


@needs_compiler
@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_asleep_in_a_wait_are_woken_by_the_last_rank_to_arrive(world_size):
    ranks = mp.spawn(check_wakes, args=(world_size, find_free_port(), 0.3), nprocs=world_size, join=False)
    deadline = time.monotonic() + 120  # the ranks' futex waits are 600 s: only a wake-up ends them sooner
    while not ranks.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail("a rank asleep in an all-reduce or gather was not woken when the last rank arrived")


@needs_compiler
def test_the_engine_gathers_the_lm_head_through_shared_memory(tiny_model):
    prompts = random_prompts(5, [3, 30], TP_MODEL["vocab_size"])
    with LLM(tiny_model, tensor_parallel_size=2, device="cpu", kvcache_block_size=16) as llm:
        group = llm.executor.group
        assert group.shm_all_reduce is not None
        llm.executor.runner.samples_vocab_parallel = False  # rank 0 samples the gathered logits
        calls = []
        gather = group.shm_all_reduce.gather_to_first
        group.shm_all_reduce.gather_to_first = lambda t: calls.append(t.shape) or gather(t)
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert calls  # rank 0's LM head went through the segment
    assert [o.token_ids for o in outputs] == hf_greedy(tiny_model, prompts, GREEDY.max_tokens)


@needs_compiler
def test_ranks_sampling_their_vocabulary_slices_share_their_numbers_through_shared_memory(tiny_model):
    prompts = random_prompts(6, [3, 30], TP_MODEL["vocab_size"])
    with LLM(tiny_model, tensor_parallel_size=2, device="cpu", kvcache_block_size=16) as llm:
        shm = llm.executor.group.shm_all_reduce
        assert llm.executor.runner.samples_vocab_parallel
        dtypes, gathers = [], []
        all_reduce, gather = shm.all_reduce, shm.gather_to_first
        shm.all_reduce = lambda t: dtypes.append(t.dtype) or all_reduce(t)
        shm.gather_to_first = lambda t: gathers.append(t.shape) or gather(t)
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert torch.float64 in dtypes and not gathers  # the sampler's few numbers, no logits
    assert [o.token_ids for o in outputs] == hf_greedy(tiny_model, prompts, GREEDY.max_tokens)


RANK_SCRIPT = """
import sys, time
import torch, torch.distributed as dist
from tpengine.distributed.shm.all_reduce import connect
rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
shm, line = connect(rank, 2, dist.all_reduce)
print(shm.name, flush=True)
if rank == 1:
    time.sleep(600)  # never joins the all-reduce: killed while rank 0 waits in it
try:
    shm.all_reduce(torch.ones(1000))
except Exception as error:
    print(type(error).__name__, error, flush=True)
"""


@needs_compiler
def test_a_peer_killed_mid_all_reduce_is_raised_within_seconds_and_nothing_is_left():
    port = str(find_free_port())
    ranks = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(rank), port], stdout=subprocess.PIPE,
                              text=True) for rank in range(2)]
    try:
        names = {rank.stdout.readline().strip() for rank in ranks}
        assert len(names) == 1 and names.copy().pop().startswith("tpengine_")
        time.sleep(0.5)  # rank 0 is waiting in the all-reduce now
        ranks[1].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        out, _ = ranks[0].communicate(timeout=60)
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()
    assert time.monotonic() - killed_at < 10
    assert "PeerDiedError tensor-parallel rank 1 (pid" in out and "died during an all-reduce" in out
    assert not names & segments()


# --- in the engine ------------------------------------------------------------------------------


def test_engine_without_a_compiler_all_reduces_through_gloo_and_says_so(tiny_model, monkeypatch, tmp_path,
                                                                        caplog):
    from tpengine.kernels.cpu import paged_decode_attention, shm_allreduce
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))  # the workers inherit both
    monkeypatch.setenv("TPENGINE_CACHE_DIR", str(tmp_path))
    for kernel in (shm_allreduce, paged_decode_attention):
        kernel.load.cache_clear()
    prompts = random_prompts(4, [3, 30], TP_MODEL["vocab_size"])
    try:
        with caplog.at_level(logging.INFO, logger="tpengine"):
            with LLM(tiny_model, tensor_parallel_size=2, device="cpu", kvcache_block_size=16) as llm:
                assert llm.executor.group.shm_all_reduce is None
                outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        for kernel in (shm_allreduce, paged_decode_attention):
            kernel.load.cache_clear()
    assert [o.token_ids for o in outputs] == hf_greedy(tiny_model, prompts, GREEDY.max_tokens)
    assert "all-reduce: gloo (rank 0 has no C++ all-reduce kernel: no C++ compiler" in caplog.text


@needs_compiler
def test_worker_killed_while_rank0_waits_in_the_all_reduce_is_named_within_seconds(tiny_model):
    llm = LLM(tiny_model, tensor_parallel_size=2, device="cpu", kvcache_block_size=16)
    names = {llm.executor.ring.name, llm.executor.group.shm_all_reduce.name}
    worker = llm.executor.processes[0]
    try:
        for prompt in random_prompts(0, [20] * 3, TP_MODEL["vocab_size"]):
            llm.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
        for _ in range(3):
            llm.step()
        worker.send_signal(signal.SIGSTOP)  # rank 0's next step waits for it in the first all-reduce...
        killed_at = []
        killer = threading.Timer(1.0, lambda: (killed_at.append(time.monotonic()), worker.kill()))
        killer.start()  # ...where it dies
        with pytest.raises(WorkerFailedError, match="worker rank 1 was killed by signal SIGKILL") as failure:
            llm.step()
        raised_at = time.monotonic()
        killer.join()
    finally:
        llm.shutdown()
        worker.kill()
    assert isinstance(failure.value.__cause__, PeerDiedError)
    assert "tensor-parallel rank 1" in str(failure.value.__cause__) and "all-reduce" in str(failure.value.__cause__)
    assert raised_at - killed_at[0] < 10
    assert not names & segments()


@needs_compiler
def test_two_engines_alive_at_once_each_reduce_through_their_own_segment(tiny_model):
    prompts = random_prompts(6, [4, 25], TP_MODEL["vocab_size"])
    expected = hf_greedy(tiny_model, prompts, GREEDY.max_tokens)
    with LLM(tiny_model, tensor_parallel_size=2, device="cpu", kvcache_block_size=16) as first, \
            LLM(tiny_model, tensor_parallel_size=2, device="cpu", kvcache_block_size=16) as second:
        names = {first.executor.group.shm_all_reduce.name, second.executor.group.shm_all_reduce.name}
        for prompt in prompts:  # steps of the two engines interleave
            first.add_request(prompt, GREEDY)
            second.add_request(prompt, GREEDY)
        outputs = {id(first): {}, id(second): {}}
        while first.has_unfinished_requests() or second.has_unfinished_requests():
            for llm in (first, second):
                for output in llm.step() if llm.has_unfinished_requests() else []:
                    if output.finished:
                        outputs[id(llm)][output.request_id] = output.outputs[0].token_ids
    assert len(names) == 2
    for llm in (first, second):
        assert [tokens for _, tokens in sorted(outputs[id(llm)].items())] == expected
    assert not names & segments()
