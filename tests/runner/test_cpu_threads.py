"""Small CPU steps on one thread (runner/cpu_threads.py): which steps fit the limits, how warm-up's measurement sets
them, and an engine that moves between one thread and all of them still gives transformers' tokens."""
import os
import time

import pytest
import torch

from tests.conftest import TP_MODEL, hf_greedy, random_prompts
from tpengine import LLM, SamplingParams
from tpengine.distributed.messages import PrefillChunk, StepMessage, int_column
from tpengine.runner.cpu_threads import StepThreads

VOCAB = TP_MODEL["vocab_size"]


def decode_step(context_lens: list[int], prompt_tokens: int = 0) -> StepMessage:
    num_rows = len(context_lens)
    prefill = [PrefillChunk(num_rows, [1] * prompt_tokens, 0, True)] if prompt_tokens else []
    return StepMessage(decode_seq_ids=int_column(list(range(num_rows))), decode_tokens=int_column([0] * num_rows),
                       decode_context_lens=int_column(context_lens), prefill=prefill)


def calibrated(rows: int, tokens: int, context: int = 256, streaming: int = 0) -> StepThreads:
    threads = StepThreads(2)
    threads.max_one_thread_rows, threads.max_one_thread_tokens, threads.calibration_context = rows, tokens, context
    threads.max_streaming_tokens = streaming
    return threads


def test_decode_steps_fit_by_rows_and_by_their_context_in_all():
    threads = calibrated(rows=8, tokens=64)
    assert threads.fits_one_thread(decode_step([256] * 8))
    assert not threads.fits_one_thread(decode_step([256] * 9))
    assert threads.fits_one_thread(decode_step([1000, 500]))
    # two rows, but more context than 8 rows at the measured 256: their attention is more than was measured
    assert not threads.fits_one_thread(decode_step([3000, 100]))


def test_prompt_steps_fit_by_their_tokens_decode_rows_included():
    threads = calibrated(rows=8, tokens=64)
    assert threads.fits_one_thread(decode_step([], prompt_tokens=64))
    assert threads.fits_one_thread(decode_step([20] * 4, prompt_tokens=60))
    assert not threads.fits_one_thread(decode_step([20] * 4, prompt_tokens=61))


def test_prompt_steps_with_decode_rows_fit_up_to_the_streaming_limit():
    # requests streaming: the step may take longer on one thread, leaving a core to the HTTP side
    threads = calibrated(rows=8, tokens=64, streaming=256)
    assert threads.fits_one_thread(decode_step([20], prompt_tokens=255))
    assert not threads.fits_one_thread(decode_step([20], prompt_tokens=256))
    assert not threads.fits_one_thread(decode_step([], prompt_tokens=65))  # nothing streams: the faster count
    assert threads.fits_one_thread(decode_step([], prompt_tokens=64))


def test_an_uncalibrated_rank_never_changes_its_thread_count(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    StepThreads(2).enter(decode_step([5]))
    assert calls == []


def test_calibration_takes_the_sizes_one_thread_runs_clearly_faster(monkeypatch):
    # a step costs a fixed part to wake the second thread plus a part a unit of size, which two threads share
    # (half-milliseconds): decode wins on one thread at 1, 2 and 4 (1-4 against 6.5-8), loses at 16 (16 against 14);
    # prompts, with a larger fixed part, win at 16 and 32, lose at 64 (64 against 62) but by less than
    # STREAMING_SLOWDOWN, and by more at 128 (128 against 94). Sleeps: a busy machine cannot turn it.
    current = [2]
    monkeypatch.setattr(torch, "set_num_threads", lambda n: current.__setitem__(0, n))
    ran = {"decode": [], "prompt": []}

    def step(kind: str, fixed: float):
        def run(size: int) -> None:
            ran[kind].append(size)
            time.sleep((size if current[0] == 1 else fixed + size / 2) / 2000)
        return run

    threads = StepThreads(2)
    threads.calibrate(step("decode", 6), step("prompt", 30), [1, 2, 4, 16, 32], context_len=128,
                      max_prompt_tokens=256)
    assert (threads.max_one_thread_rows, threads.calibration_context, threads.max_one_thread_tokens) == (4, 128, 32)
    assert threads.max_streaming_tokens == 64
    assert max(ran["decode"]) == 16 and max(ran["prompt"]) == 128  # no size past the first one thread loses
    assert current[0] == 2  # every thread again once measured


@pytest.fixture
def two_threads():
    """This process on two threads for the test (an earlier test may have left it on one), as it was after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.skipif(torch.cuda.is_available() or (os.cpu_count() or 1) < 2, reason="a CPU rank with two threads")
def test_an_engine_moving_between_one_thread_and_all_gives_transformers_tokens(tiny_model, two_threads, monkeypatch):
    counts = []
    set_num_threads = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (counts.append(n), set_num_threads(n)))
    # prompts under and over the one-thread limit; the batch shrinks through it as the shorter requests finish
    prompts = random_prompts(61, [5, 40, 12, 3, 70, 9], VOCAB)
    lengths = [4, 12, 6, 16, 8, 10]
    with LLM(tiny_model, kvcache_block_size=16, max_num_seqs=8, max_num_batched_tokens=64) as llm:
        threads = llm.executor.runner.step_threads
        threads.max_one_thread_rows, threads.max_one_thread_tokens = 3, 24
        outputs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                                         for n in lengths], use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outputs] == [hf_greedy(tiny_model, [p], n)[0]
                                                             for p, n in zip(prompts, lengths)]
    assert 1 in counts and 2 in counts
    assert torch.get_num_threads() == 2  # the closed engine gave its process every thread back
