"""The start-up warm-up (warm_up=True, runner/warmup.py): every decode batch size's first step paid before any request,
and nothing a request sees changed by it, on one rank or several."""
import pytest
import torch

from tests.conftest import TP_MODEL, hf_greedy, random_prompts
from tpengine import LLM, SamplingParams
from tpengine.runner.cpu_replay import DecodeCpuReplays
from tpengine.runner.warmup import decode_sizes, prompt_sizes

VOCAB = TP_MODEL["vocab_size"]


def test_decode_sizes_are_the_cpu_row_buckets_and_the_cuda_graph_sizes():
    from tpengine.platforms.cpu import row_bucket
    assert decode_sizes(torch.device("cpu"), row_bucket, 20) == [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24]
    assert decode_sizes(torch.device("cuda"), None, 20) == [1, 2, 4, 8, 16, 32]


def test_prompt_sizes_stop_at_the_largest_step():
    assert prompt_sizes(2048) == [16, 256, 2048]
    assert prompt_sizes(100) == [16, 100]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path")
def test_every_row_bucket_is_recorded_before_the_first_request(tiny_model):
    with LLM(tiny_model, kvcache_block_size=16, max_num_seqs=16, warm_up=True) as llm:
        replays = llm.executor.runner.decode_path.replays
        assert isinstance(replays, DecodeCpuReplays)
        assert sorted(replays.replays) == [1, 2, 3, 4, 5, 6, 7, 8, 12, 16]
        assert all(replay is not None for replay in replays.replays.values())
        assert not llm.executor.runner.inputs.block_tables.tables  # the dummy sequences left no table behind


def generate(path, prompts, params, **engine_kwargs):
    with LLM(path, kvcache_block_size=16, **engine_kwargs) as llm:
        return [[c.token_ids for c in out.outputs] for out in llm.generate(prompts, params, use_tqdm=False)]


def test_a_warmed_engine_samples_the_same_tokens_as_a_cold_one(tiny_model):
    # greedy, seeded, and unseeded sampled rows (those draw from the engine's generator, which the warm-up must
    # leave as it was)
    prompts = random_prompts(51, [5, 23, 40, 9], VOCAB)
    params = [SamplingParams(temperature=0.0, max_tokens=10), SamplingParams(temperature=0.9, seed=7, max_tokens=10),
              SamplingParams(temperature=1.0, max_tokens=10, n=2), SamplingParams(temperature=0.7, max_tokens=10)]
    cold = generate(tiny_model, prompts, params)
    assert generate(tiny_model, prompts, params, warm_up=True) == cold


def test_every_rank_warms_up_and_the_tokens_stay_transformers(tiny_model):
    # the ranks run the same dummy steps: their all-reduces and the LM head's gather line up
    prompts = random_prompts(52, [7, 30, 3], VOCAB)
    device = "auto" if torch.cuda.device_count() >= 2 else "cpu"  # a rank a GPU, else two CPU ranks
    tokens = generate(tiny_model, prompts, SamplingParams(temperature=0.0, max_tokens=8), tensor_parallel_size=2,
                      warm_up=True, max_num_seqs=8, device=device)
    assert [t[0] for t in tokens] == hf_greedy(tiny_model, prompts, 8)
