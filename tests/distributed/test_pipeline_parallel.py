"""Pipeline parallelism with real worker processes and gloo point-to-point sends: greedy tokens equal
transformers' with several steps in flight, sampling equals one stage's, and a killed stage fails cleanly."""
import time

import pytest

from tests.conftest import TP_MODEL, hf_greedy, random_prompts
from tests.leftovers import segments
from tpengine import LLM, SamplingParams, WorkerFailedError

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _count_steps_in_flight(llm) -> list[int]:
    """How many steps were in flight each time rank 0 waited for the oldest one's tokens."""
    seen = []
    collect = llm.executor.collect

    def counting(plan):
        seen.append(len(llm.scheduler.in_flight))
        return collect(plan)
    llm.executor.collect = counting
    return seen


@pytest.mark.parametrize("tp,block_size", [(1, 16), (2, 256)])
def test_greedy_matches_transformers_with_steps_in_flight_chunks_and_prefix_hits(tied_model, tp, block_size):
    # the default shape (4 layers, tied embeddings: the last stage reads its LM head from the embedding's tensor)
    prompts = random_prompts(3, [1, 16, 40, 70, 9, 33], 320)
    expected = hf_greedy(tied_model, prompts, GREEDY.max_tokens)
    with LLM(tied_model, pipeline_parallel_size=2, tensor_parallel_size=tp, kvcache_block_size=block_size,
             max_num_batched_tokens=48) as llm:
        in_flight = _count_steps_in_flight(llm)
        first = llm.generate(prompts, GREEDY, use_tqdm=False)
        second = llm.generate(prompts, GREEDY, use_tqdm=False)
        # every virtual engine took a share of the requests, and their steps overlapped
        assert all(scheduler.num_steps > 1 for scheduler in llm.scheduler.schedulers)
        assert max(in_flight) == 2
    assert [o.token_ids for o in first] == expected
    assert [o.token_ids for o in second] == expected
    # a request lands where its prompt is cached: all but each prompt's last token are hits
    assert [o.num_cached_tokens for o in second] == [len(p) - 1 for p in prompts]


def test_uneven_stages_and_preemption_match_transformers(tied_model):
    prompts = random_prompts(4, [30, 41, 25, 37], 320)
    with LLM(tied_model, pipeline_parallel_size=2, pp_layer_partition=[3, 1], kvcache_block_size=16,
             num_kvcache_blocks=12) as llm:
        assert [s.block_manager.num_blocks for s in llm.scheduler.schedulers] == [6, 6]
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                               use_tqdm=False)
        assert llm.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outputs] == hf_greedy(tied_model, prompts, 40)


def test_sampling_is_the_same_with_and_without_a_pipeline(tiny_model):
    """Plain rows are sampled on the last stage (only token ids come back); filtered rows with logprobs
    bring their logits to rank 0's sampler: both give one stage's tokens."""
    prompts = random_prompts(9, [5, 30, 12], TP_MODEL["vocab_size"])
    plain = SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True, seed=7)
    filtered = SamplingParams(temperature=0.8, top_k=40, max_tokens=8, ignore_eos=True, seed=11, logprobs=2)
    results = {}
    for pp in (1, 2):
        with LLM(tiny_model, pipeline_parallel_size=pp, kvcache_block_size=16) as llm:
            results[pp] = [(o.outputs[0].token_ids, [sorted(lp) for lp in o.outputs[0].logprobs or []])
                           for params in (plain, filtered) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert results[1] == results[2]


def test_abort_and_shutdown_during_steps_in_flight_keep_the_ledger_whole_and_leave_nothing(tied_model):
    prompts = random_prompts(6, [12, 20, 7, 15], 320)
    with LLM(tied_model, pipeline_parallel_size=2, kvcache_block_size=16) as llm:
        ids = [llm.add_request(p, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)) for p in prompts]
        for _ in range(3):
            llm.step()
        assert llm.scheduler.in_flight
        aborted = llm.abort(ids[1])
        assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
        finished = {}
        while llm.has_unfinished_requests():
            for output in llm.step():
                if output.finished:
                    finished[output.request_id] = output
        assert all(s.block_manager.num_free_blocks == s.block_manager.num_blocks for s in llm.scheduler.schedulers)
        # shut down with steps in flight: every rank finishes its steps and takes the shutdown, none is killed
        processes = list(llm.executor.processes)
        for prompt in prompts[:2]:
            llm.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
        for _ in range(3):
            llm.step()
        assert llm.scheduler.in_flight
        started = time.monotonic()
        llm.shutdown()
        assert time.monotonic() - started < 5
        assert all(p.returncode == 0 for p in processes)
    expected = hf_greedy(tied_model, prompts, 30)
    for i in (0, 2, 3):
        assert finished[ids[i]].outputs[0].token_ids == expected[i]


def test_a_killed_stage_fails_the_step_naming_its_pipeline_and_tensor_parallel_rank(tiny_model):
    segments_before = segments()
    llm = LLM(tiny_model, pipeline_parallel_size=2, tensor_parallel_size=2, kvcache_block_size=16)
    last_stage = llm.executor.processes[2]  # global rank 3: stage 1, tensor-parallel rank 1
    try:
        for prompt in random_prompts(0, [20] * 3, TP_MODEL["vocab_size"]):
            llm.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
        for _ in range(3):
            llm.step()
        last_stage.kill()
        deadline = time.monotonic() + 20
        with pytest.raises(WorkerFailedError, match=r"worker rank 3 \(pipeline-parallel rank 1, tensor-parallel "
                                                    r"rank 1\) was killed by signal SIGKILL"):
            while time.monotonic() < deadline:
                llm.step()
    finally:
        llm.shutdown()
    assert all(p.poll() is not None for p in llm.executor.processes)
    assert segments() <= segments_before
    with pytest.raises(RuntimeError, match="shut down"):
        llm.step()


@pytest.mark.parametrize("kwargs,message", [
    (dict(pipeline_parallel_size=5), "pipeline_parallel_size=5 is more than the model's 4 layers"),
    (dict(pipeline_parallel_size=2, pp_layer_partition=[4, 0]), r"pp_layer_partition=\[4, 0\] must be 2 counts"),
    (dict(pipeline_parallel_size=2, pp_layer_partition=[1, 2]), "add up to the model's 4 layers"),
    (dict(pipeline_parallel_size=0), "pipeline_parallel_size must be an integer >= 1"),
])
def test_bad_pipeline_settings_raise_before_any_process_starts(tied_model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(tied_model, **kwargs)


def test_ngram_speculation_through_the_pipeline_matches_transformers(tied_model):
    prompts = [p * 3 for p in random_prompts(8, [5, 9, 7], 320)]  # repeats for the n-gram proposer to find
    with LLM(tied_model, pipeline_parallel_size=2, kvcache_block_size=16,
             speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                               use_tqdm=False)
        assert llm.spec_decode_stats["num_drafts"] > 0
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(tied_model, prompts, 24)



def test_the_last_stage_samples_constrained_rows_with_the_masks_from_the_step_message(tied_model):
    import re

    from tpengine import StructuredOutputsParams
    regex = r"[a-z]{3,8}-\d{2}"
    with LLM(tied_model, pipeline_parallel_size=2, kvcache_block_size=16, max_model_len=384) as llm:
        outputs = llm.generate([f"p {i}" for i in range(6)],
                               [SamplingParams(temperature=1.0, seed=i, max_tokens=64,
                                               structured_outputs=StructuredOutputsParams(regex=regex))
                                for i in range(6)], use_tqdm=False)
    assert all(re.fullmatch(regex, o.outputs[0].text) for o in outputs), [o.outputs[0].text for o in outputs]


@pytest.mark.parametrize("checkpoint", ["qwen3_moe", "gpt_oss", "gpt_oss_mxfp4"])
def test_mixture_of_experts_checkpoints_split_over_stages_match_transformers(checkpoint):
    # each stage loads only its own layers' experts (the stacked expert tensors take their own names)
    from tests.models.gpt_oss import gpt_oss_checkpoint, mxfp4_checkpoint
    from tests.models.moe import moe_checkpoint
    path = {"qwen3_moe": moe_checkpoint, "gpt_oss": gpt_oss_checkpoint, "gpt_oss_mxfp4": mxfp4_checkpoint}[checkpoint]()
    prompts = random_prompts(17, [3, 40], 300)
    with LLM(path, pipeline_parallel_size=2, kvcache_block_size=16) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    # transformers dequantizes an MXFP4 checkpoint itself on the CPU
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(path, prompts, GREEDY.max_tokens)
