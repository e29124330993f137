"""Timed runs of an engine: a warm-up shaped like the run first, so nothing compiles inside the timed window, and
on CUDA a synchronize at each end of it."""
import statistics
import sys
import time
from collections.abc import Callable

from tpengine.bench.workload import random_prompts, warm_up_workload


def sync(device: str) -> None:
    if device == "cuda":
        import torch
        torch.cuda.synchronize()


def device_of(llm) -> str:
    """"cuda" or "cpu": where the engine's device setting ("auto" too) runs it."""
    from tpengine.distributed.parallel_state import resolve_device
    return resolve_device(llm.config.device).type


def compiled_graphs() -> int | None:
    """Graphs torch.compile has built in this process so far (dynamo's own counter), None if unknown."""
    try:
        from torch._dynamo.utils import counters
        return counters["stats"]["unique_graphs"]
    except (ImportError, KeyError, AttributeError):
        return None


def time_generate(llm, prompts: list[list[int]], output_lens: list[int], temperature: float,
                  device: str = "cpu") -> tuple[float, int | None]:
    """One timed llm.generate of prompts, each writing exactly its output length (ignore_eos), after a warm-up on
    warm_up_workload's batches: (seconds, graphs torch.compile built on rank 0 inside the timed window: 0 when the
    warm-up covered every shape, None if unknown)."""
    from tpengine import SamplingParams

    for warm_prompts, warm_lens in warm_up_workload(prompts, output_lens):
        llm.generate(warm_prompts, [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True)
                                    for n in warm_lens], use_tqdm=False)
    params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True) for n in output_lens]
    sync(device)
    graphs_before = compiled_graphs()
    print("[tpengine] timed generate starts", file=sys.stderr, flush=True)  # TORCH_LOGS after this are in it
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    sync(device)
    elapsed = time.perf_counter() - started
    print("[tpengine] timed generate ends", file=sys.stderr, flush=True)
    graphs_after = compiled_graphs()
    assert [len(o.token_ids) for o in outputs] == list(output_lens), "tpengine wrote other lengths than asked"
    return elapsed, None if graphs_before is None or graphs_after is None else graphs_after - graphs_before


def time_calls(call: Callable[[], object], num_iters_warmup: int, num_iters: int, device: str = "cpu") -> list[float]:
    """Seconds of each of num_iters calls, after num_iters_warmup untimed ones."""
    for _ in range(num_iters_warmup):
        call()
    seconds = []
    for _ in range(num_iters):
        sync(device)
        started = time.perf_counter()
        call()
        sync(device)
        seconds.append(time.perf_counter() - started)
    return seconds


def decode_step_ms(llm, rng, batch: int, context_len: int, steps: int, warm_up_steps: int) -> float:
    """Median ms of llm.step() over `steps` decode steps of `batch` sequences of context_len random prompt tokens
    (greedy, ignore_eos), after their prefill and warm_up_steps decode steps."""
    return prompts_decode_step_ms(llm, random_prompts(rng, batch, context_len, llm.vocab_size), steps, warm_up_steps)


def prompts_decode_step_ms(llm, prompts: list[list[int]], steps: int, warm_up_steps: int,
                           lora_requests: list | None = None) -> float:
    """decode_step_ms of given prompts, row i on lora_requests[i] if given (None: no adapter)."""
    from tpengine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=warm_up_steps + steps + 2, ignore_eos=True)
    for prompt, lora in zip(prompts, lora_requests or [None] * len(prompts)):
        llm.add_request(prompt, params, stream=False, lora_request=lora)
    while llm.scheduler.waiting:  # the prompts' prefill steps
        llm.step()
    for _ in range(warm_up_steps):
        llm.step()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        llm.step()
        times.append(time.perf_counter() - started)
    while llm.has_unfinished_requests():
        llm.step()
    return statistics.median(times) * 1e3
