"""A finished or aborted request's state (sequences, token lists, text, logprobs) is freed when it ends,
by reference counting alone: a long-lived engine thread never waits for the cycle collector."""
import gc
import random
import tracemalloc

import pytest

from tpengine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tied_model):  # the tiny model with its byte tokenizer: stop strings and text are real
    with LLM(tied_model, kvcache_block_size=16, num_kvcache_blocks=128, max_model_len=256, max_num_seqs=16) as llm:
        yield llm


def mixed_requests(llm, count: int, seed: int) -> None:
    """Requests through add_request/step as a server drives them: streamed and not, n=4, logprobs, long
    stop strings, and every fifth one aborted after a step or two."""
    rng = random.Random(seed)
    live = []
    for i in range(count):
        params = SamplingParams(n=rng.choice([1, 4]), temperature=rng.choice([0.0, 0.8]), max_tokens=rng.randint(4, 12),
                                ignore_eos=True, logprobs=rng.choice([None, 5]),
                                stop=rng.choice([None, ["\n\n", "xy" * 2000]]))
        prompt = [rng.randrange(1, 250) for _ in range(rng.randint(3, 40))]
        request_id = llm.add_request(prompt, params, stream=bool(i % 2))
        if i % 5 == 4:
            live.append(request_id)
        llm.step()
        if len(live) > 1:
            llm.abort(live.pop(0))
    for request_id in live:
        llm.abort(request_id)
    while llm.has_unfinished_requests():
        llm.step()


def test_memory_returns_to_its_level_after_hundreds_of_requests_without_the_cycle_collector(llm):
    mixed_requests(llm, 20, seed=0)  # warm-up: caches, the prefix index and the tokenizer tables fill
    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        mixed_requests(llm, 20, seed=1)
        start, _ = tracemalloc.get_traced_memory()
        mixed_requests(llm, 150, seed=2)
        end, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        gc.enable()
    assert not llm._requests and llm.scheduler.is_finished()
    # a leak of the requests' state alone would be several MB (their token lists and logprob dicts)
    assert end - start < 512 * 1024, f"{(end - start) / 1024:.0f} KiB more after 150 requests"
