"""Multi-rank engines on CUDA. On a host with one GPU the documented one-GPU test mode (every rank on
GPU 0, gloo collectives on CUDA tensors, eager) runs them; NCCL cases need two GPUs. Skipped without CUDA."""
import time

import pytest
import torch

from tests.conftest import TP_MODEL, hf_greedy, random_prompts
from tests.leftovers import assert_nothing_left, snapshot
from tpengine import LLM, SamplingParams, WorkerFailedError
from tpengine.distributed.parallel_state import ONE_GPU_TEST_MODE_ENV

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
ENGINE = dict(tensor_parallel_size=2, device="cuda", dtype="float32", kvcache_block_size=16,
              max_num_batched_tokens=48, max_num_seqs=8, gpu_memory_utilization=0.3)


@pytest.fixture
def one_gpu_mode(monkeypatch):
    monkeypatch.setenv(ONE_GPU_TEST_MODE_ENV, "1")


def _a_killed_decoding_worker_is_an_error_naming_its_rank(model, **engine):
    before = snapshot()
    llm = LLM(model, **engine)
    try:
        for prompt in random_prompts(0, [20] * 3, TP_MODEL["vocab_size"]):
            llm.add_request(prompt, LONG)
        for _ in range(3):
            llm.step()
        llm.executor.processes[0].kill()
        deadline = time.monotonic() + 30
        with pytest.raises(WorkerFailedError, match="worker rank 1 was killed by signal SIGKILL"):
            while time.monotonic() < deadline:
                llm.step()
    finally:
        llm.shutdown()
    assert_nothing_left(before)


def test_tp2_on_one_gpu_matches_transformers_with_chunked_prefill_and_prefix_hits(tiny_model, one_gpu_mode):
    prompts = random_prompts(2, [1, 16, 40, 100], TP_MODEL["vocab_size"])
    expected = hf_greedy(tiny_model, prompts, GREEDY.max_tokens)
    with LLM(tiny_model, **ENGINE) as llm:
        assert llm.executor.runner.decode_path.replays is None  # gloo collectives cannot be captured
        first = llm.generate(prompts, GREEDY, use_tqdm=False)
        second = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in first] == expected
    assert [o.token_ids for o in second] == expected
    assert [o.num_cached_tokens for o in second] == [0, 0, 32, 96]


def test_a_worker_killed_on_one_gpu_is_an_error_naming_its_rank(tiny_model, one_gpu_mode):
    _a_killed_decoding_worker_is_an_error_naming_its_rank(tiny_model, **ENGINE)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL with two ranks needs two GPUs")
def test_a_worker_killed_inside_an_nccl_collective_is_an_error_within_seconds(tiny_model):
    # NCCL does not fail the collective rank 0 waits in: the watcher aborts the communicator
    _a_killed_decoding_worker_is_an_error_naming_its_rank(tiny_model, **{**ENGINE, "gpu_memory_utilization": 0.5})


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL with two ranks needs two GPUs")
def test_tp2_over_nccl_matches_transformers(tiny_model):
    prompts = random_prompts(3, [7, 50], TP_MODEL["vocab_size"])
    with LLM(tiny_model, **ENGINE) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == hf_greedy(tiny_model, prompts, GREEDY.max_tokens)


def test_more_ranks_than_gpus_is_a_value_error_naming_both(tiny_model):
    visible = torch.cuda.device_count()
    tp = 4 if visible < 4 else 8
    if tp > visible and TP_MODEL["num_attention_heads"] % tp == 0:
        with pytest.raises(ValueError, match=f"tensor_parallel_size={tp} needs one GPU per rank, "
                                             f"but {visible} GPU\\(s\\) are visible"):
            LLM(tiny_model, tensor_parallel_size=tp, device="cuda")
    else:
        pytest.skip(f"{visible} GPUs: no tensor-parallel size the tiny model allows exceeds them")
