"""Qwen3-VL MoE with images gives transformers' greedy tokens: Qwen3-VL's vision tower, deepstack and interleaved
M-RoPE, with Qwen3-MoE's experts (the router always renormalising) in the sparse layers and a dense MLP in
mlp_only_layers; at tp 1 (blocks 16, 16-token chunks cutting through both images) and tp 2 (blocks 256), again from
the prefix cache; and from the released checkpoints' transposed expert tensors."""
import os
import shutil

import pytest
import torch

from tests.leftovers import session_folder
from tests.models.test_qwen2_5_vl import generate, image_requests, reference
from tests.models.vision import IMAGE_TOKEN_ID, vl_checkpoint
from tpengine import LLM

QWEN3_VL_MOE = "Qwen3VLMoeForConditionalGeneration"


@pytest.mark.parametrize("tp, block_size, chunk", [(1, 16, 16), (2, 256, 2048)])
def test_greedy_matches_transformers_then_again_from_the_prefix_cache(tp, block_size, chunk):
    path, requests = vl_checkpoint(QWEN3_VL_MOE), image_requests()
    expected = reference(path, requests)
    with LLM(path, tensor_parallel_size=tp, kvcache_block_size=block_size, max_num_batched_tokens=chunk) as llm:
        first = generate(llm, requests)
        again = generate(llm, requests)
    assert [list(o.outputs[0].token_ids) for o in first] == expected
    assert [list(o.outputs[0].token_ids) for o in again] == expected
    assert first[0].prompt_token_ids.count(IMAGE_TOKEN_ID) == 12
    if block_size == 16:
        assert all(o.num_cached_tokens >= 16 for o in again[:2])


def released_layout_copy(path: str) -> str:
    """The checkpoint with its expert tensors as the released Qwen3-VL MoE checkpoints hold them: gate_up_proj
    [experts, hidden, 2 * intermediate], down_proj [experts, intermediate, hidden]."""
    from safetensors.torch import load_file, save_file
    copy = session_folder(prefix="tpengine-qwen3-vl-moe-released-")
    for name in os.listdir(path):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(path, name), copy)
    for name in (n for n in os.listdir(path) if n.endswith(".safetensors")):
        tensors = load_file(os.path.join(path, name))
        stacked = [k for k in tensors if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]
        assert stacked, "transformers wrote no stacked expert tensors"
        for key in stacked:
            tensors[key] = tensors[key].transpose(1, 2).contiguous()
        save_file(tensors, os.path.join(copy, name), metadata={"format": "pt"})
    return copy


def test_the_released_checkpoints_transposed_experts_load_alike():
    path, requests = vl_checkpoint(QWEN3_VL_MOE), image_requests()
    with LLM(released_layout_copy(path), kvcache_block_size=16) as llm:
        outputs = generate(llm, requests)
    assert [list(o.outputs[0].token_ids) for o in outputs] == reference(path, requests)


def test_the_tiny_model_routes_and_its_outputs_differ():
    """The random checkpoint is not degenerate: its requests' greedy tokens are not one token repeated, and the
    router's weights are drawn (not transformers' zeros)."""
    from safetensors import safe_open
    path = vl_checkpoint(QWEN3_VL_MOE)
    expected = reference(path, image_requests())
    assert all(len(set(tokens)) > 1 for tokens in expected) and len({tuple(t) for t in expected}) == 3
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        router = f.get_tensor("model.language_model.layers.0.mlp.gate.weight")
    assert router.shape == (4, 64) and torch.count_nonzero(router) == router.numel()
