"""Phi-3 / Phi-3.5 / Phi-4 (Phi3ForCausalLM) give transformers' greedy tokens: plain, a sliding window shorter than
the prompts, LongRoPE within its original window, past it, passing it as it generates (recomputed, as
transformers' generate does) and all of those in one batch, speculation included, and Phi-4-mini's partial
rotary; tp 1, 2 and 4, block sizes 16 and 256, chunked prefill, prefix hits and preemption, on the torch and auto
backends. The fused checkpoint tensors split into each rank's q/k/v heads and gate/up slices: float, quantized at
load, quantized in the checkpoint."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import _hf_model, hf_greedy, random_prompts
from tests.models.families import WINDOW, family_checkpoint
from tests.models.parity import GREEDY, assert_parity, check_preemption, check_twice_with_prefix_hits
from tests.models.test_quantized_models import (check_online, online_reference, prompts_with_shared_prefix,
                                                quantized_checkpoint)
from tests.quantization.checkpoints import CheckpointFormat
from tpengine import LLM, SamplingParams
from tpengine.attention import make_backend
from tpengine.distributed.parallel_state import TensorParallelGroup, building_model_for
from tpengine.hf_config import load_hf_config
from tpengine.models.loader import load_model
from tpengine.models.registry import model_class

ORIGINAL_WINDOW = 64  # the LongRoPE checkpoints' original_max_position_embeddings
# setup -> (checkpoint, max_model_len (None: the model's, 1024), prompt lengths). LongRoPE (models/phi3.py), in
# engines whose sequences may pass the window: short, prompts whose generation stays within it (the short
# factors); long, prompts past it from the start (the long factors); crossing, prompts whose generation passes it
# (transformers recomputes them with the long set, the engine preempts them); mixed, all three in one batch
SETUPS = {
    "phi3": ("phi3", None, [1, 20, 100]),
    "phi3_window": ("phi3_window", None, [1, WINDOW - 24, WINDOW - 23, 100]),
    "longrope_short": ("phi3_longrope", None, [1, 20, ORIGINAL_WINDOW - GREEDY.max_tokens]),
    "longrope_long": ("phi3_longrope", None, [ORIGINAL_WINDOW + 1, 100]),
    "longrope_crossing": ("phi3_longrope", None, [ORIGINAL_WINDOW - 3, ORIGINAL_WINDOW - 7, ORIGINAL_WINDOW]),
    "longrope_mixed": ("phi3_longrope", None, [20, ORIGINAL_WINDOW - 4, ORIGINAL_WINDOW, ORIGINAL_WINDOW + 1, 100]),
    "phi4_mini_short": ("phi4_mini", None, [3, 30, ORIGINAL_WINDOW - GREEDY.max_tokens]),
    "phi4_mini_long": ("phi4_mini", None, [ORIGINAL_WINDOW + 6, 120]),
    "phi4_mini_mixed": ("phi4_mini", None, [30, ORIGINAL_WINDOW - 2, ORIGINAL_WINDOW + 6]),
}
# (setup, tp, block size, attention backend)
CASES = [
    ("phi3", 1, 16, "torch"), ("phi3", 2, 256, "auto"),
    ("phi3_window", 1, 16, "auto"), ("phi3_window", 4, 16, "torch"),  # tp 4: KV heads replicated
    # short, long and crossing alone at tp 1; all of them in one batch at tp 1 and 2, both block sizes
    ("longrope_short", 1, 256, "torch"), ("longrope_long", 1, 16, "auto"), ("longrope_crossing", 1, 16, "torch"),
    ("longrope_mixed", 1, 16, "auto"), ("longrope_mixed", 2, 16, "torch"), ("longrope_mixed", 2, 256, "auto"),
    ("phi4_mini_short", 1, 16, "auto"), ("phi4_mini_long", 2, 16, "torch"), ("phi4_mini_mixed", 1, 16, "torch"),
]


def setup_prompts(setup: str) -> list[list[int]]:
    name, _, lengths = SETUPS[setup]
    prompts = random_prompts(len(setup), lengths, 300)
    if "mixed" in setup:  # a short prompt that is the head of a long one: their blocks hold different K/V
        prompts.append(prompts[-1][:ORIGINAL_WINDOW - 24])
    return prompts


@pytest.mark.parametrize("setup, tp, block_size, backend", CASES, ids=lambda v: str(v))
def test_greedy_matches_transformers_with_chunked_prefill_and_prefix_hits(setup, tp, block_size, backend):
    name, max_model_len, _ = SETUPS[setup]
    settings = {} if max_model_len is None else {"max_model_len": max_model_len}
    # 24: the longer prompts prefill in chunks
    check_twice_with_prefix_hits(family_checkpoint(name), setup_prompts(setup),
                                 tensor_parallel_size=tp, kvcache_block_size=block_size, attention_backend=backend,
                                 max_num_batched_tokens=24, **settings)


def test_longrope_short_prompts_differ_with_the_long_factors():
    """The setups above show the factor set: transformers' tokens for a short prompt differ from what the long set
    gives it (one forward over a sequence past the window rotates it all with the long set)."""
    path = family_checkpoint("phi3_longrope")
    prompt = random_prompts(3, [40], 300)[0]
    padded = prompt + random_prompts(4, [ORIGINAL_WINDOW], 300)[0]  # past the window: the long set for every token
    with torch.inference_mode():
        short = _hf_model(path)(torch.tensor([prompt])).logits[0]
        long = _hf_model(path)(torch.tensor([padded])).logits[0, :len(prompt)]
    assert not torch.equal(short.argmax(-1), long.argmax(-1))


def test_preemption_recomputes_with_the_long_factors_and_still_matches():
    prompts = random_prompts(5, [ORIGINAL_WINDOW + 2, ORIGINAL_WINDOW + 6, ORIGINAL_WINDOW - 4], 300)
    # two prompts at a time, then short; the third passes the window as it generates
    check_preemption(family_checkpoint("phi3_longrope"), prompts, max_tokens=20, num_kvcache_blocks=10)


@pytest.mark.parametrize("policy", ["mixed", "prefill_first"])
def test_longrope_generation_past_the_window_is_recomputed_as_transformers_generate_does(policy):
    """A prompt within the window whose generation passes it: transformers' generate recomputes the sequence with
    the long factors at the step that passes the window; the engine preempts it there and prefills it again."""
    path = family_checkpoint("phi3_longrope")
    prompts = random_prompts(11, [ORIGINAL_WINDOW - 14, 10], 300)
    with LLM(path, kvcache_block_size=16, scheduling_policy=policy) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                               use_tqdm=False)
        assert llm.scheduler.num_preemptions == 1  # the first prompt's, at 65 tokens
    assert_parity(path, prompts, outputs, 30)


@pytest.mark.parametrize("tp", [1, 2])
def test_ngram_speculation_keeps_a_short_sequence_within_the_window_and_recomputes_it_past_it(tp):
    path = family_checkpoint("phi3_longrope")
    loop = random_prompts(12, [6], 300)[0]
    # repeated tokens: the n-gram proposes; the first passes the window as it generates, the second is past it
    prompts = [loop * 9, (loop * 12)[:ORIGINAL_WINDOW + 5], random_prompts(13, [30], 300)[0]]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "adaptive": False}
    with LLM(path, kvcache_block_size=16, speculative_config=spec, tensor_parallel_size=tp) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                               use_tqdm=False)
        assert llm.scheduler.num_draft_tokens > 0 and llm.scheduler.num_preemptions >= 1
    assert_parity(path, prompts, outputs, 24)


def test_a_longrope_draft_model_drafts_with_each_row_s_factor_set():
    """The model as its own draft: its drafts (decode rows on the ranks) and their verify rows rotate with the set
    of their sequence, so every draft is accepted and the tokens are transformers'."""
    path = family_checkpoint("phi3_longrope")
    prompts = random_prompts(14, [ORIGINAL_WINDOW - 6, ORIGINAL_WINDOW + 3, 12], 300)
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 3, "adaptive": False}
    with LLM(path, kvcache_block_size=16, speculative_config=spec) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                               use_tqdm=False)
        assert llm.scheduler.num_accepted_tokens == llm.scheduler.num_draft_tokens > 0
    assert_parity(path, prompts, outputs, 16)


def test_a_draft_model_without_the_model_s_longrope_is_refused():
    spec = {"method": "draft_model", "model": family_checkpoint("phi3"), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="must use LongRoPE with the same original_max_position_embeddings"):
        LLM(family_checkpoint("phi3_longrope"), speculative_config=spec)


def rank_model(path: str, rank: int, size: int):
    """One rank's shard of the checkpoint, loaded in this process (a stand-in group: nothing runs)."""
    config = load_hf_config(path)
    group = TensorParallelGroup(rank, size, process_group=object())
    with building_model_for(group):
        model = model_class(config)(config, make_backend("torch"))
    load_model(model, path)
    return model


def test_fused_qkv_and_gate_up_split_into_each_rank_s_heads_and_slices():
    path = family_checkpoint("phi3")
    config = json.load(open(os.path.join(path, "config.json")))
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    q_size, kv_size = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    intermediate = config["intermediate_size"]
    tensors = load_file(os.path.join(path, "model.safetensors"))
    for rank in range(2):
        layer = rank_model(path, rank, 2).model.layers[1]
        qkv = tensors["model.layers.1.self_attn.qkv_proj.weight"]
        q, k, v = qkv.split([q_size, kv_size, kv_size])
        # this rank's 2 of 4 query heads and 1 of 2 KV heads, in q, k, v order
        expected = torch.cat([part.chunk(2)[rank] for part in (q, k, v)])
        assert torch.equal(layer.self_attn.qkv_proj.weight, expected)
        gate, up = tensors["model.layers.1.mlp.gate_up_proj.weight"].split([intermediate, intermediate])
        assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat([gate.chunk(2)[rank], up.chunk(2)[rank]]))


def test_online_int8_splits_the_fused_tensors_quantized_whole_at_tp2(tmp_path):
    path = family_checkpoint("phi3")
    reference = online_reference(path, str(tmp_path / "reference"), 8, None)
    with LLM(path, quantization="int8", tensor_parallel_size=2, kvcache_block_size=16) as llm:
        check_online(llm, reference, prompts_with_shared_prefix(300), tensor_parallel_size=2)


def test_a_gptq_checkpoint_of_fused_tensors_splits_at_tp2(tmp_path_factory):
    fmt = CheckpointFormat("gptq", bits=4, group_size=16)
    quantized, reference, modules = quantized_checkpoint(family_checkpoint("phi3"), fmt,
                                                         str(tmp_path_factory.mktemp("quantized_phi3")))
    assert "model.layers.0.self_attn.qkv_proj" in modules and "model.layers.0.mlp.gate_up_proj" in modules
    prompts = prompts_with_shared_prefix(300)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(quantized, tensor_parallel_size=2, kvcache_block_size=16) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outputs] == hf_greedy(reference, prompts, 8)
