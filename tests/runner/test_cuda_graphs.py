"""Decode through CUDA graphs: the same greedy tokens as eager decode and as transformers.

Capture and replay need CUDA; the buckets, the static-buffer bookkeeping and the CPU path are checked anywhere.
"""
import functools
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import TP_MODEL, hf_greedy, random_prompts
from tpengine import LLM, SamplingParams
from tpengine.runner.cuda_graphs import DecodeCudaGraphs, graph_batch_sizes
from tpengine.runner.decode_path import ReplayedDecode

VOCAB = TP_MODEL["vocab_size"]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_buckets_are_powers_of_two_to_8_then_steps_of_16_covering_max_num_seqs():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(5) == [1, 2, 4, 8]
    assert graph_batch_sizes(100) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112]
    assert graph_batch_sizes(512)[-3:] == [480, 496, 512]
    assert graph_batch_sizes(4096)[-1] == 512  # larger batches run eagerly


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path")
def test_cpu_never_captures_graphs(tiny_model):
    with LLM(tiny_model, kvcache_block_size=16) as llm:
        assert not isinstance(llm.executor.runner.decode_path.replays, DecodeCudaGraphs)
        assert llm.executor.runner.activation_peak_bytes == 0


def count_replays(graphs) -> list[int]:
    """The batch size of every decode step that goes through graphs.run from now on."""
    batch_sizes = []
    run = graphs.run
    graphs.run = lambda input_ids, *rest: batch_sizes.append(input_ids.size(0)) or run(input_ids, *rest)
    return batch_sizes


class ReplayEagerly(DecodeCudaGraphs):
    """The graphs' bookkeeping without CUDA: a 'replay' runs the forward again over the static buffers."""

    def _capture_all(self):
        for batch_size in self.batch_sizes:
            self.graphs[batch_size] = SimpleNamespace(
                replay=functools.partial(self._forward, batch_size, self._metadata(batch_size)))


def test_static_buffers_padding_and_slicing_keep_greedy_tokens(tiny_model):
    # runs anywhere: what replay reads (padded static inputs, metadata over them) gives transformers' tokens
    prompts = random_prompts(20, [1, 17, 40, 5, 9], VOCAB)
    max_tokens = [9, 7, 5, 3, 1]  # decode batches of 4, 3, 2 and 1: padded to buckets 4, 4, 2, 1
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    with LLM(tiny_model, kvcache_block_size=16, max_num_seqs=8, attention_backend="torch") as llm:
        runner = llm.executor.runner
        graphs = ReplayEagerly(runner.model, runner.hf_config.hidden_size, runner.dtype, runner.device, 8,
                               runner.max_num_blocks_per_seq, runner.block_size)
        runner.decode_path = ReplayedDecode(runner.model, graphs)
        batch_sizes = count_replays(graphs)
        outputs = llm.generate(prompts, params, use_tqdm=False)
    assert batch_sizes == [4, 4, 3, 3, 2, 2, 1, 1]
    expected = hf_greedy(tiny_model, prompts, max(max_tokens))
    assert [o.token_ids for o in outputs] == [ref[:n] for ref, n in zip(expected, max_tokens)]


def test_buckets_hold_the_verify_rows_of_every_sequence_when_speculating():
    assert graph_batch_sizes(4, num_speculative_tokens=3) == [1, 2, 4, 8, 16]
    assert graph_batch_sizes(200, num_speculative_tokens=4)[-1] == 512


def test_verify_steps_replay_graphs_and_keep_greedy_tokens(tiny_model):
    # a verify row is 1 + k decode queries: with speculation the buckets reach max_num_seqs * (1 + k) rows
    segment = random_prompts(22, [6], VOCAB)[0]
    prompts = [segment * 5, random_prompts(23, [30], VOCAB)[0]]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2,
            "adaptive": False}
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with LLM(tiny_model, kvcache_block_size=16, max_num_seqs=2, attention_backend="torch",
             speculative_config=spec) as llm:
        runner = llm.executor.runner
        graphs = ReplayEagerly(runner.model, runner.hf_config.hidden_size, runner.dtype, runner.device, 2,
                               runner.max_num_blocks_per_seq, runner.block_size, num_speculative_tokens=3)
        runner.decode_path = ReplayedDecode(runner.model, graphs)
        batch_sizes = count_replays(graphs)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.spec_decode_stats["num_drafts"] > 0
    assert max(batch_sizes) > 2  # verify steps went through the graphs
    assert [o.token_ids for o in outputs] == hf_greedy(tiny_model, prompts, 16)


def graph_replays(runner) -> list[int]:
    graphs = runner.decode_path.replays
    return count_replays(graphs) if isinstance(graphs, DecodeCudaGraphs) else []


def greedy_tokens(path, prompts, max_tokens, count_replays_of=graph_replays, **engine_kwargs):
    """Each prompt gets its own max_tokens, so decode batches shrink step by step through the buckets; with the rows
    of every replayed step (count_replays_of(runner) returns the list it fills)."""
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    with LLM(path, dtype="float32", **engine_kwargs) as llm:
        replays = count_replays_of(llm.executor.runner)
        outputs = llm.generate(prompts, params, use_tqdm=False)
    return [o.token_ids for o in outputs], replays


@needs_cuda
@pytest.mark.parametrize("block_size", [16, 256])
def test_greedy_with_cuda_graphs_equals_eager_and_transformers(tiny_model, block_size):
    prompts = random_prompts(21, [1, 17, block_size + 3, 40, 5], VOCAB)
    max_tokens = [12, 10, 7, 3, 1]  # decode batches of 4, 3 (padded to 4), 2 and 1 sequences
    graphed, replays = greedy_tokens(tiny_model, prompts, max_tokens, kvcache_block_size=block_size,
                                     attention_backend="triton")
    eager, no_replays = greedy_tokens(tiny_model, prompts, max_tokens, kvcache_block_size=block_size,
                                      attention_backend="triton", enforce_eager=True)
    assert sorted(set(replays)) == [1, 2, 3, 4] and not no_replays
    assert graphed == eager
    assert graphed == [ref[:n] for ref, n in zip(hf_greedy(tiny_model, prompts, 12), max_tokens)]


def test_batches_past_the_largest_bucket_or_wider_tables_are_left_to_eager():
    graphs = ReplayEagerly(model=None, hidden_size=8, dtype=torch.float32, device=torch.device("cpu"),
                           max_num_seqs=1000, max_num_blocks_per_seq=4, block_size=16)
    assert graphs.can_run(1, 1) and graphs.can_run(512, 4)
    assert not graphs.can_run(513, 4)  # past the 512 bucket
    assert not graphs.can_run(3, 5)    # a block table wider than the static one


@needs_cuda
def test_decode_batch_past_the_largest_bucket_runs_eagerly_and_matches(tiny_model):
    prompts = random_prompts(22, [3] * 520, VOCAB)
    tokens, replays = greedy_tokens(tiny_model, prompts, [3] * 520, kvcache_block_size=16, max_num_seqs=520)
    assert not replays  # every decode step held 520 sequences
    checked = [0, 1, 519]
    assert [tokens[i] for i in checked] == hf_greedy(tiny_model, [prompts[i] for i in checked], 3)


@needs_cuda
def test_triton_backend_on_cuda_equals_torch_backend_and_transformers(tiny_model):
    prompts = random_prompts(23, [2, 30, 300], VOCAB)
    max_tokens = [8, 8, 8]
    triton_tokens, _ = greedy_tokens(tiny_model, prompts, max_tokens, kvcache_block_size=256,
                                     attention_backend="triton")
    torch_tokens, torch_replays = greedy_tokens(tiny_model, prompts, max_tokens, kvcache_block_size=256,
                                                attention_backend="torch")
    assert not torch_replays  # the torch backend's store cannot be captured: it decodes eagerly
    assert triton_tokens == torch_tokens == hf_greedy(tiny_model, prompts, 8)


@needs_cuda
def test_warm_up_reserves_the_prefill_activation_peak(tiny_model):
    # one decode row: the sampler's reserve is small, and the MLP's gate/up output of a 512-token prefill
    # ([512, 2 x 128] float32, live while the step runs) is a floor the measured peak must reach
    with LLM(tiny_model, dtype="float32", kvcache_block_size=16, max_num_batched_tokens=512, max_num_seqs=1) as llm:
        assert llm.executor.runner.activation_peak_bytes >= 512 * 2 * TP_MODEL["intermediate_size"] * 4


@needs_cuda
def test_warm_up_reserves_the_samplers_full_vocabulary_rows_at_max_num_seqs(tiny_model):
    # 64 batched tokens need little; 512 decode rows' float32 logits and float64 cumulative sums do not
    with LLM(tiny_model, dtype="float32", kvcache_block_size=16, max_num_batched_tokens=64, max_num_seqs=512) as llm:
        assert llm.executor.runner.activation_peak_bytes >= 512 * VOCAB * (4 + 8)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_greedy_with_cuda_graphs_at_tp_2_matches_transformers(tiny_model):
    prompts = random_prompts(24, [1, 16, 40], VOCAB)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(tiny_model, dtype="float32", tensor_parallel_size=2, kvcache_block_size=16,
             attention_backend="triton") as llm:
        # graphs are on at tp=2, not silently eager
        assert isinstance(llm.executor.runner.decode_path.replays, DecodeCudaGraphs)
        outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outputs] == hf_greedy(tiny_model, prompts, 8)
