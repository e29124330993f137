"""Phi-3 / Phi-3.5 / Phi-4 (Phi3ForCausalLM) give transformers' greedy tokens: plain, a sliding window shorter than
the prompts, LongRoPE within its original window and past it, and Phi-4-mini's partial rotary; tp 1, 2 and 4, block
sizes 16 and 256, chunked prefill, prefix hits and preemption, on the torch and auto backends. The fused checkpoint
tensors split into each rank's q/k/v heads and gate/up slices: float, quantized at load, quantized in the checkpoint."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import _hf_model, hf_greedy, random_prompts
from tests.models.families import WINDOW, family_checkpoint
from tests.models.parity import GREEDY, check_preemption, check_twice_with_prefix_hits
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
# setup -> (checkpoint, max_model_len (None: the model's), prompt lengths). LongRoPE (models/phi3.py): short, an
# engine whose sequences stay within the original window (the short factors, as transformers has them there); long,
# prompts past the window from the start (the long factors, as transformers has them for the whole sequence)
SETUPS = {
    "phi3": ("phi3", None, [1, 20, 100]),
    "phi3_window": ("phi3_window", None, [1, WINDOW - 24, WINDOW - 23, 100]),
    "longrope_short": ("phi3_longrope", ORIGINAL_WINDOW, [1, 20, ORIGINAL_WINDOW - GREEDY.max_tokens]),
    "longrope_long": ("phi3_longrope", None, [ORIGINAL_WINDOW + 1, 100]),
    "phi4_mini_short": ("phi4_mini", ORIGINAL_WINDOW, [3, 30, ORIGINAL_WINDOW - GREEDY.max_tokens]),
    "phi4_mini_long": ("phi4_mini", None, [ORIGINAL_WINDOW + 6, 120]),
}
# (setup, tp, block size, attention backend)
CASES = [
    ("phi3", 1, 16, "torch"), ("phi3", 2, 256, "auto"),
    ("phi3_window", 1, 16, "auto"), ("phi3_window", 4, 16, "torch"),  # tp 4: KV heads replicated
    ("longrope_short", 1, 256, "torch"), ("longrope_short", 2, 16, "auto"),
    ("longrope_long", 1, 16, "auto"), ("longrope_long", 2, 256, "torch"),
    ("phi4_mini_short", 1, 16, "auto"), ("phi4_mini_long", 2, 16, "torch"),
]


@pytest.mark.parametrize("setup, tp, block_size, backend", CASES, ids=lambda v: str(v))
def test_greedy_matches_transformers_with_chunked_prefill_and_prefix_hits(setup, tp, block_size, backend):
    name, max_model_len, lengths = SETUPS[setup]
    settings = {} if max_model_len is None else {"max_model_len": max_model_len}
    # 24: the longer prompts prefill in chunks
    check_twice_with_prefix_hits(family_checkpoint(name), random_prompts(len(setup), lengths, 300),
                                 tensor_parallel_size=tp, kvcache_block_size=block_size, attention_backend=backend,
                                 max_num_batched_tokens=24, **settings)


def test_preemption_recomputes_with_the_long_factors_and_still_matches():
    prompts = random_prompts(5, [ORIGINAL_WINDOW + 2, ORIGINAL_WINDOW + 6, ORIGINAL_WINDOW + 4], 300)
    # two prompts at a time, then short
    check_preemption(family_checkpoint("phi3_longrope"), prompts, max_tokens=20, num_kvcache_blocks=10)


def test_longrope_generation_past_the_window_rotates_as_transformers_after_its_recompute():
    """A prompt within the window whose generation passes it: transformers' generate recomputes the sequence with the
    long factors at the step that passes the window, so from that step on it computes what one forward over the
    whole sequence does, which is what the engine (the long set throughout) computes at every step."""
    path = family_checkpoint("phi3_longrope")
    prompt = random_prompts(11, [ORIGINAL_WINDOW - 14], 300)[0]
    with LLM(path, kvcache_block_size=16) as llm:
        tokens = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                              use_tqdm=False)[0].token_ids
    with torch.inference_mode():
        logits = _hf_model(path)(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    assert tokens == logits.argmax(-1).tolist()


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
