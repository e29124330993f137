"""tp > 1 with real worker processes (all-reduce through shared memory on one CPU host): greedy tokens equal
transformers', in both launch modes."""
import json
import logging
import os
import subprocess
import sys

import pytest

from tests.conftest import TP_MODEL, hf_greedy, random_prompts
from tpengine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("tp", [2, 4])
def test_greedy_matches_transformers_with_chunked_prefill_and_prefix_hits(tiny_model, tp):
    # vocabulary 1003 (padded at tp=4), 2 KV heads (replicated at tp=4), head_dim 48
    prompts = random_prompts(tp, [1, 16, 40, 100], TP_MODEL["vocab_size"])
    expected = hf_greedy(tiny_model, prompts, GREEDY.max_tokens)
    with LLM(tiny_model, tensor_parallel_size=tp, kvcache_block_size=16, max_num_batched_tokens=48) as llm:
        first = llm.generate(prompts, GREEDY, use_tqdm=False)
        second = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in first] == expected
    assert [o.token_ids for o in second] == expected
    # exact reuse, all but each prompt's last token: block heads copied on every rank (the seed's whole
    # blocks gave [0, 0, 32, 96])
    assert [o.num_cached_tokens for o in second] == [0, 15, 39, 99]


def test_greedy_matches_transformers_at_tp_3_with_the_shared_memory_all_reduce(tmp_path, caplog):
    from tpengine.kernels.cpu.build import has_compiler
    from tpengine.tiny_model import write_tiny_model
    # 6 heads / 3 KV heads, intermediate 192: every split by 3 is even; vocabulary 1003 padded to 1005
    model = write_tiny_model(str(tmp_path / "tp3"), seed=3, with_tokenizer=False,
                             **{**TP_MODEL, "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 16,
                                "intermediate_size": 192})
    prompts = random_prompts(5, [1, 17, 60], TP_MODEL["vocab_size"])
    with caplog.at_level(logging.INFO, logger="tpengine"):
        with LLM(model, tensor_parallel_size=3, device="cpu", kvcache_block_size=16,
                 max_num_batched_tokens=32) as llm:
            outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == hf_greedy(model, prompts, GREEDY.max_tokens)
    if has_compiler():
        assert "all-reduce: shared memory (3 ranks on one host)" in caplog.text


def test_sampling_with_seed_is_the_same_at_tp_1_and_2(tiny_model):
    prompts = random_prompts(9, [5, 30], TP_MODEL["vocab_size"])
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, max_tokens=8, ignore_eos=True, seed=1234)
    outputs = {}
    for tp in (1, 2):
        with LLM(tiny_model, tensor_parallel_size=tp, kvcache_block_size=16) as llm:
            outputs[tp] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outputs[1] == outputs[2]
    assert outputs[1] != hf_greedy(tiny_model, prompts, params.max_tokens)  # really sampled, not greedy


def test_heads_not_divisible_by_tp_raise_before_any_process_starts(tiny_model, monkeypatch):
    from tpengine.runner import multiproc_executor

    def no_worker_may_start(*args, **kwargs):
        raise AssertionError("a worker process was started before the settings were checked")

    monkeypatch.setattr(multiproc_executor.subprocess, "Popen", no_worker_may_start)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide the model's 4 attention heads"):
        LLM(tiny_model, tensor_parallel_size=3)


def test_torchrun_launch_matches_transformers(tiny_model):
    prompts = ["Hello, tensor parallel world", "abc"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               os.path.join(REPO, "launch", "generate.py"), "--model", tiny_model, "--max-tokens", "8",
               "--ignore-eos", "--block-size", "16", "--device", "cpu", "--json", *prompts]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    outputs = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [o["prompt"] for o in outputs] == prompts
    expected = hf_greedy(tiny_model, [o["prompt_token_ids"] for o in outputs], 8)
    assert [o["token_ids"] for o in outputs] == expected


@pytest.mark.parametrize("path", ["each rank samples its slice", "rank 0 samples the gathered logits"])
def test_vocabulary_padding_is_never_sampled_at_tp_4(tiny_model, path):
    from tpengine.kernels.cpu import sampling as cpu_sampling
    vocab_parallel = path == "each rank samples its slice"
    if vocab_parallel and not cpu_sampling.available():
        pytest.skip("the CPU sampling kernel does not build here")
    vocab = TP_MODEL["vocab_size"]  # 1003: padded to 1004 at tp=4
    params = SamplingParams(temperature=50.0, max_tokens=32, ignore_eos=True)
    with LLM(tiny_model, tensor_parallel_size=4, kvcache_block_size=16) as llm:
        lm_head = llm.executor.runner.model.lm_head
        assert lm_head.num_embeddings_per_partition * 4 == vocab + 1
        llm.executor.runner.samples_vocab_parallel = vocab_parallel  # rank 0 decides each step's path
        sampler, widths = llm.executor.sampler, []

        def recording_sampler(logits, *args):
            widths.append(logits.size(1))
            return sampler(logits, *args)

        llm.executor.runner.sampler = recording_sampler  # rank 0's runner samples gathered logits
        outputs = llm.generate(random_prompts(5, [3] * 8, vocab), params, use_tqdm=False)
    if vocab_parallel:
        assert not widths  # no step gathered the logits
    else:
        assert widths and set(widths) == {vocab}  # the gathered logits lose the padding column
    tokens = [t for o in outputs for t in o.token_ids]
    assert len(tokens) == 8 * 32 and max(tokens) < vocab
    # near-uniform sampling reaches the whole vocabulary, the last rank's shard included
    assert len(set(tokens)) > 150 and any(t >= 3 * lm_head.num_embeddings_per_partition for t in tokens)


def test_a_row_gets_the_same_token_whether_the_ranks_sample_their_slices_or_rank_0_the_gathered_logits(tiny_model):
    from tpengine.kernels.cpu import sampling as cpu_sampling
    if not cpu_sampling.available():
        pytest.skip("the CPU sampling kernel does not build here")
    prompts = random_prompts(31, [4, 40, 9, 17, 23, 5, 31, 12], TP_MODEL["vocab_size"])
    plain = [SamplingParams(temperature=t, seed=s, max_tokens=10, ignore_eos=True)
             for t, s in zip([0.0, 0.7, 1.0, 1.3, 0.0, 2.0, 0.9, 0.5], range(8))]
    # a batch mate asking for logprobs makes every step it is in sample the gathered logits on rank 0
    gathering = SamplingParams(temperature=0.8, seed=99, logprobs=2, max_tokens=12, ignore_eos=True)
    with LLM(tiny_model, tensor_parallel_size=2, kvcache_block_size=16) as llm:
        steps = []
        send = llm.executor.send_to_workers
        llm.executor.send_to_workers = lambda envelope: steps.append(envelope.vocab_parallel is not None) or \
            send(envelope)
        alone = [o.token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
        assert steps and all(steps)  # every step sampled on the ranks' slices
        steps.clear()
        mixed = llm.generate(prompts + [prompts[0]], plain + [gathering], use_tqdm=False)
        assert steps and not any(steps)
    assert [o.token_ids for o in mixed[:-1]] == alone
    assert alone[0] == hf_greedy(tiny_model, prompts[:1], 10)[0]
    assert len({tuple(t) for t in alone}) == len(alone)


def test_two_node_torchrun_pipeline_sends_steps_over_the_gloo_broadcast(tiny_model):
    # Two torchrun "nodes" on this host: LOCAL_WORLD_SIZE (1) != WORLD_SIZE (2), so no shared memory; a pipeline
    # stage per node, as across real nodes (--tp defaults to the world size over --pp: 1)
    from tpengine.distributed.parallel_state import find_free_port
    endpoint = f"127.0.0.1:{find_free_port()}"
    prompts = ["multi node", "x"]
    nodes = []
    for node_rank in range(2):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                   "--node-rank", str(node_rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                   "--rdzv-id", "tpengine-test", os.path.join(REPO, "launch", "generate.py"), "--model", tiny_model,
                   "--max-tokens", "6", "--ignore-eos", "--block-size", "16", "--device", "cpu", "--pp", "2", "--json",
                   *prompts]
        nodes.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO))
    try:
        results = [node.communicate(timeout=240) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert all(node.returncode == 0 for node in nodes), [err[-2000:] for _, err in results]
    assert "control plane to 1 workers: gloo broadcast" in results[0][1]
    outputs = [json.loads(line) for out, _ in results for line in out.splitlines() if line.startswith("{")]
    assert [o["prompt"] for o in outputs] == prompts
    assert [o["token_ids"] for o in outputs] == hf_greedy(tiny_model, [o["prompt_token_ids"] for o in outputs], 6)


def test_prompt_longer_than_the_cpu_token_budget_matches_transformers_at_tp_2(tmp_path):
    # the CPU's default budget is DEFAULT_MAX_NUM_BATCHED_TOKENS a step: this prompt spans three steps, the
    # first two of which end no sequence (no token sampled), while the short one decodes next to them
    from tpengine.platforms.cpu import DEFAULT_MAX_NUM_BATCHED_TOKENS
    from tpengine.tiny_model import write_tiny_model
    model = write_tiny_model(str(tmp_path / "long"), seed=2, with_tokenizer=False,
                             **{**TP_MODEL, "max_position_embeddings": 8192})
    prompts = random_prompts(31, [2 * DEFAULT_MAX_NUM_BATCHED_TOKENS + 100, 7], TP_MODEL["vocab_size"])
    with LLM(model, tensor_parallel_size=2, device="cpu", max_model_len=8192) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == hf_greedy(model, prompts, GREEDY.max_tokens)
