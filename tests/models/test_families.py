"""Every dense family gives transformers' greedy tokens: tp 1, 2 and 4 where the heads divide, block sizes 16 and
256, chunked prefill, prefix hits and preemption, on the torch, cpu and (interpreted) Triton backends."""
import pytest

from tests.conftest import random_prompts
from tests.models.families import WINDOW, family_checkpoint
from tests.models.parity import assert_parity, check_preemption, check_twice_with_prefix_hits
from tpengine import LLM, SamplingParams
from tpengine.engine.block_manager import compute_block_hash

# 100 tokens pass llama3's and YaRN's 64-token original window, 260 a block of 256 (qwen2's limit is 256: 4 x 64);
# the window families' prompts fill the window, end one past it and run several windows past it
PROMPT_LENGTHS = {"llama": [1, 20, 100, 260], "llama_tied": [1, 20, 100, 260], "mistral": [1, 20, 100, 260],
                  "qwen2": [1, 20, 100, 240], "mistral_window": [1, WINDOW, WINDOW + 1, 260],
                  "qwen2_window": [1, 20, 100, 300]}


def family_prompts(name: str) -> list[list[int]]:
    return random_prompts(len(name), PROMPT_LENGTHS[name], 300)


# (family, tp, block size, attention backend): each family at tp 1 on both CPU backends and both block sizes,
# and beyond tp 1 where its heads divide; qwen2 at tp 4 replicates its 2 KV heads, q/k/v biases with them
CASES = [
    ("llama", 1, 16, "torch"), ("llama", 1, 256, "auto"), ("llama", 2, 16, "auto"),
    ("llama_tied", 1, 16, "auto"), ("llama_tied", 1, 256, "torch"),
    ("qwen2", 1, 16, "auto"), ("qwen2", 1, 256, "torch"), ("qwen2", 4, 16, "auto"),
    ("mistral", 1, 16, "torch"), ("mistral", 1, 256, "auto"),
    ("mistral_window", 1, 16, "auto"), ("mistral_window", 2, 256, "auto"),
    ("qwen2_window", 1, 256, "auto"), ("qwen2_window", 2, 16, "torch"),
]


@pytest.mark.parametrize("name, tp, block_size, backend", CASES, ids=lambda v: str(v))
def test_greedy_matches_transformers_with_chunked_prefill_and_prefix_hits(name, tp, block_size, backend):
    # 48: the longer prompts prefill in chunks
    check_twice_with_prefix_hits(family_checkpoint(name), family_prompts(name), tensor_parallel_size=tp,
                                 kvcache_block_size=block_size, attention_backend=backend, max_num_batched_tokens=48)


@pytest.mark.parametrize("name", ["qwen2", "mistral_window"])  # the scheduler's part is the same for every family
def test_preemption_under_a_small_cache_still_matches(name):
    path = family_checkpoint(name)
    # each request needs up to 3-5 blocks of 16; 8 blocks hold two at a time; the window's outputs run past it
    check_preemption(path, random_prompts(5, [30, 31, 29, 40, 18], 300), max_tokens=30)


# head_dim 32 with 3:1 GQA; 32; 16; a window that the second prompt passes
@pytest.mark.parametrize("name", ["llama_tied", "qwen2", "mistral", "mistral_window"])
def test_triton_backend_matches_transformers_with_a_prefix_hit(name):
    pytest.importorskip("triton")
    path = family_checkpoint(name)
    prompts = random_prompts(6, [3, 20 if name != "mistral_window" else WINDOW + 5], 300)  # the interpreter is slow
    check_twice_with_prefix_hits(path, prompts, 4, kvcache_block_size=16, attention_backend="triton")


def test_blocks_released_behind_the_window_serve_other_requests_and_tokens_stay_exact():
    path = family_checkpoint("mistral_window")  # every layer slides: the ledger releases blocks behind the window
    prompts = random_prompts(7, [60, 70, 50], 300)
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    # each request grows to 11 blocks of 16: three need 33 blocks kept, but at most 5 each once released
    with LLM(path, kvcache_block_size=16, num_kvcache_blocks=16, max_num_batched_tokens=32) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.scheduler.num_preemptions == 0
    assert_parity(path, prompts, outputs, 100)


def test_a_prompt_longer_than_the_whole_cache_runs_where_every_layer_slides():
    path = family_checkpoint("mistral_window")
    prompts = random_prompts(8, [300], 300)
    # 8 blocks of 16 hold 128 tokens; the prompt's chunks of 32 take the blocks their window and tokens need
    with LLM(path, kvcache_block_size=16, num_kvcache_blocks=8, max_num_batched_tokens=32) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert_parity(path, prompts, outputs, 40)


def test_a_prefix_hit_past_overwritten_blocks_behind_the_window_stays_exact():
    path = family_checkpoint("mistral_window")  # window 48: position 192 sees blocks 9 on
    first, other = random_prompts(9, [200, 60], 300)
    again = first + random_prompts(10, [5], 300)[0]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(path, kvcache_block_size=16, num_kvcache_blocks=16, max_num_batched_tokens=32) as llm:
        llm.generate([first], params, use_tqdm=False)
        llm.generate([other], params, use_tqdm=False)  # takes the free blocks, first's block 0 among them
        assert compute_block_hash(first[:16]) not in llm.scheduler.block_manager.hash_to_block_id
        output = llm.generate([again], params, use_tqdm=False)[0]
    assert output.num_cached_tokens == 200  # all of first, though its block 0 was overwritten
    assert_parity(path, [again], [output])
