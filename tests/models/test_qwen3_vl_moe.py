"""Qwen3-VL MoE from the released checkpoints' transposed expert tensors gives transformers' greedy tokens, and its
tiny test model is not degenerate. Its parity at tp 1 and 2, chunked and from the prefix cache, is
tests/models/test_qwen2_5_vl.py's, with the other Qwen image models'."""
import os
import shutil

import torch

from tests.leftovers import session_folder
from tests.models.test_qwen2_5_vl import QWEN3_VL_MOE, generate, image_requests, reference
from tests.models.vision import vl_checkpoint
from tpengine import LLM


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
