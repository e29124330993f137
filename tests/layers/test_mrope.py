"""M-RoPE: mrope_positions equals transformers' get_rope_index (Qwen2.5-VL's and Qwen3-VL's) for text and
images, and MRotaryEmbedding equals Qwen2_5_VLRotaryEmbedding / Qwen3VLTextRotaryEmbedding with
apply_rotary_pos_emb; 1-D positions are plain RoPE."""
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import Qwen2_5_VLTextConfig, Qwen3VLTextConfig
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as qwen2_5_vl
from transformers.models.qwen3_vl import modeling_qwen3_vl as qwen3_vl

from tpengine.hf_config import RopeParameters
from tpengine.layers.layernorm import RMSNorm
from tpengine.layers.mrope import MRotaryEmbedding, get_mrope, section_rows
from tpengine.layers.rotary_embedding import RotaryEmbedding
from tpengine.multimodal.mrope_positions import mrope_positions
from tpengine.platforms.torch_ops import apply_rotary_pointwise

IMAGE_TOKEN, MERGE = 151655, 2
HEADS, KV_HEADS, HEAD_DIM, SECTION, MAX_POSITION = 4, 2, 32, (4, 6, 6), 4096
ROPE = RopeParameters(theta=10_000.0)


# --- positions -------------------------------------------------------------------------------------

def prompt(*parts, seed=0) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Token ids and grids of parts: an int is that many text tokens, a (t, h, w) grid an image's run."""
    rng = np.random.default_rng(seed)
    ids, grids = [], []
    for part in parts:
        if isinstance(part, int):
            ids += rng.integers(0, 1000, part).tolist()
        else:
            grids.append(part)
            ids += [IMAGE_TOKEN] * (part[0] * (part[1] // MERGE) * (part[2] // MERGE))
    return ids, grids


def transformers_rope_index(model_class, ids: list[int], grids) -> tuple[np.ndarray, int]:
    # the method reads only the merge size (and, for videos, tokens_per_second) and get_vision_position_ids
    stub = SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(
        spatial_merge_size=MERGE, tokens_per_second=2)))
    stub.get_vision_position_ids = lambda *args, **kwargs: model_class.get_vision_position_ids(stub, *args, **kwargs)
    input_ids = torch.tensor([ids])
    positions, deltas = model_class.get_rope_index(
        stub, input_ids, (input_ids == IMAGE_TOKEN).int(), torch.tensor(grids) if grids else None)
    return positions[:, 0].numpy(), int(deltas[0, 0])


PROMPTS = {
    "text only": (17,),
    "one image in the middle": (5, (1, 4, 6), 7),
    "two images of different grids": (3, (1, 8, 4), 4, (1, 6, 10), 2),
    "image at the start": ((1, 6, 4), 9),
    "image at the end": (6, (1, 4, 8)),
    "image alone": ((1, 4, 4),),
    "two frames": (4, (2, 4, 6), 3),
    "more frames than rows": (4, (4, 2, 2), 3, (3, 2, 4), 2),
    "many images": (30, (1, 28, 40), 11, (1, 2, 2), 1, (1, 64, 12), 40, (2, 8, 8), 5),
}


@pytest.mark.parametrize("model_class", [qwen2_5_vl.Qwen2_5_VLModel, qwen3_vl.Qwen3VLModel])
@pytest.mark.parametrize("parts", PROMPTS.values(), ids=PROMPTS.keys())
def test_positions_equal_transformers_get_rope_index(model_class, parts):
    ids, grids = prompt(*parts)
    positions, delta = mrope_positions(ids, grids, IMAGE_TOKEN, MERGE)
    expected, expected_delta = transformers_rope_index(model_class, ids, grids)
    assert positions.dtype == np.int64 and positions.shape == (3, len(ids))
    np.testing.assert_array_equal(positions, expected)
    assert delta == expected_delta


def test_text_only_is_arange_with_no_delta():
    positions, delta = mrope_positions(list(range(10)), [], IMAGE_TOKEN, MERGE)
    np.testing.assert_array_equal(positions, np.tile(np.arange(10), (3, 1)))
    assert delta == 0


def test_long_prompt_equals_transformers():
    parts = [part for i in range(40) for part in (2000 + i, (1, 2 * (i % 7 + 1), 2 * (i % 5 + 3)))]
    ids, grids = prompt(*parts, 100)
    positions, delta = mrope_positions(ids, grids, IMAGE_TOKEN, MERGE)
    expected, expected_delta = transformers_rope_index(qwen2_5_vl.Qwen2_5_VLModel, ids, grids)
    np.testing.assert_array_equal(positions, expected)
    assert delta == expected_delta


@pytest.mark.parametrize("parts, grids, message", [
    ((5, (1, 4, 4), 3), [(1, 4, 4), (1, 4, 4)], r"1 run\(s\).*lengths \[4\].*expect 2 image\(s\) of lengths \[4, 4\]"),
    ((5, (1, 4, 4), 3), [], r"1 run\(s\).*expect 0 image\(s\)"),
    ((5, (1, 4, 4), 3), [(1, 4, 8)], r"lengths \[4\].*lengths \[8\]"),
    ((5, (1, 4, 4), (1, 4, 4)), [(1, 4, 4), (1, 4, 4)], r"1 run\(s\) of image token 151655 of lengths \[8\]"),
])
def test_runs_that_do_not_match_the_grids_raise(parts, grids, message):
    ids, _ = prompt(*parts)
    with pytest.raises(ValueError, match=message):
        mrope_positions(ids, grids, IMAGE_TOKEN, MERGE)


def test_positions_load_neither_torch_nor_transformers():
    # the scheduler process computes them, and it starts without torch
    script = ("import sys, tpengine.multimodal.mrope_positions\n"
              "print([m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')])")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr[-2000:]


# --- rotary ----------------------------------------------------------------------------------------

def qkv_views(num_tokens: int, seed=0):
    """q and k as the model hands them over: strided views into one qkv projection output."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g)
    q, k, _ = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    return q.view(num_tokens, HEADS, HEAD_DIM), k.view(num_tokens, KV_HEADS, HEAD_DIM)


def random_positions(num_tokens: int, seed=1) -> torch.Tensor:
    return torch.randint(0, MAX_POSITION, (3, num_tokens), generator=torch.Generator().manual_seed(seed))


def transformers_mrope(interleaved: bool, positions, q, k, q_norm=None, k_norm=None):
    rope = {"rope_type": "default", "rope_theta": ROPE.theta, "mrope_section": list(SECTION)}
    if interleaved:
        config = Qwen3VLTextConfig(hidden_size=64, num_attention_heads=HEADS, head_dim=HEAD_DIM,
                                   rope_parameters={**rope, "mrope_interleaved": True})
        rotary, apply = qwen3_vl.Qwen3VLTextRotaryEmbedding(config), qwen3_vl.apply_rotary_pos_emb
    else:
        config = Qwen2_5_VLTextConfig(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, rope_parameters=rope)
        rotary, apply = qwen2_5_vl.Qwen2_5_VLRotaryEmbedding(config), qwen2_5_vl.apply_rotary_pos_emb
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    cos, sin = rotary(q, positions[:, None])  # [1, tokens, head_dim]
    q_embed, k_embed = apply(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    return q_embed[0].transpose(0, 1), k_embed[0].transpose(0, 1)


def reference_norms(seed=2):
    """Qwen3-VL's q/k RMSNorms, random weights, and ours with the same weights."""
    g = torch.Generator().manual_seed(seed)
    theirs = [qwen3_vl.Qwen3VLTextRMSNorm(HEAD_DIM, eps=1e-6) for _ in range(2)]
    ours = [RMSNorm(HEAD_DIM, eps=1e-6) for _ in range(2)]
    for their, our in zip(theirs, ours):
        weight = 1 + 0.3 * torch.randn(HEAD_DIM, generator=g)
        their.weight.data.copy_(weight)
        our.weight.data.copy_(weight)
    return theirs, ours


@pytest.mark.parametrize("with_norms", [False, True], ids=["plain", "qk_norm"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["qwen2_5_vl", "qwen3_vl"])
def test_rotary_equals_transformers(interleaved, with_norms):
    positions = random_positions(37)
    q, k = qkv_views(37)
    (their_q_norm, their_k_norm), (our_q_norm, our_k_norm) = reference_norms() if with_norms else ((None,) * 2,) * 2
    with torch.no_grad():
        expected = transformers_mrope(interleaved, positions, q.clone(), k.clone(), their_q_norm, their_k_norm)
        rope = MRotaryEmbedding(HEAD_DIM, MAX_POSITION, ROPE, SECTION, interleaved)
        ours = rope(positions, *qkv_views(37), our_q_norm, our_k_norm)
    for got, want in zip(ours, expected):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("interleaved", [False, True], ids=["qwen2_5_vl", "qwen3_vl"])
def test_rotary_in_cudas_pointwise_form_equals_transformers(interleaved):
    positions = random_positions(29, seed=3)
    q, k = qkv_views(29)
    with torch.no_grad():
        expected = transformers_mrope(interleaved, positions, q.clone(), k.clone())
    rope = MRotaryEmbedding(HEAD_DIM, MAX_POSITION, ROPE, SECTION, interleaved)
    rope.qk_norm_rotary = lambda positions, q, k, q_norm, k_norm, cache: apply_rotary_pointwise(positions, q, k, cache)
    for got, want in zip(rope(positions, *qkv_views(29)), expected):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_partial_rotary_with_three_equal_rows_is_plain_rope():
    rope_parameters = RopeParameters(theta=10_000.0, partial_rotary_factor=0.5)  # 8 of the 16 frequencies
    positions = torch.tensor([3, 0, 900, 41])
    plain = RotaryEmbedding(HEAD_DIM, MAX_POSITION, rope_parameters)
    rope = MRotaryEmbedding(HEAD_DIM, MAX_POSITION, rope_parameters, (2, 3, 3))
    with torch.no_grad():
        expected = plain(positions, *qkv_views(4))
        for ours in (rope(positions, *qkv_views(4)), rope(positions.expand(3, -1), *qkv_views(4))):
            assert all(torch.equal(a, b) for a, b in zip(ours, expected))


@pytest.mark.parametrize("with_norms", [False, True], ids=["plain", "qk_norm"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["qwen2_5_vl", "qwen3_vl"])
def test_one_dimensional_positions_are_plain_rope_and_equal_three_equal_rows(interleaved, with_norms):
    positions = torch.tensor([0, 5, 4095, 17, 300, 2, 2])
    _, (q_norm, k_norm) = reference_norms() if with_norms else (None, (None, None))
    rope = MRotaryEmbedding(HEAD_DIM, MAX_POSITION, ROPE, SECTION, interleaved)
    plain = RotaryEmbedding(HEAD_DIM, MAX_POSITION, ROPE)
    with torch.no_grad():
        one_row = rope(positions, *qkv_views(7), q_norm, k_norm)
        expected = plain(positions, *qkv_views(7), q_norm, k_norm)
        three_rows = rope(positions.expand(3, -1), *qkv_views(7), q_norm, k_norm)
    for ours, theirs, rows in zip(one_row, expected, three_rows):
        assert torch.equal(ours, theirs) and torch.equal(rows, theirs)


def test_section_rows_follow_transformers_layouts():
    assert section_rows((2, 3, 3), interleaved=False) == [0, 0, 1, 1, 1, 2, 2, 2]
    assert section_rows((4, 2, 2), interleaved=True) == [0, 1, 2, 0, 1, 2, 0, 0]


def test_sections_must_cover_the_rotary_frequencies():
    with pytest.raises(ValueError, match=r"mrope_section \[4, 6, 4\].*head size 32"):
        MRotaryEmbedding(HEAD_DIM, 64, ROPE, (4, 6, 4))
    with pytest.raises(ValueError, match="three sections"):
        MRotaryEmbedding(HEAD_DIM, 64, ROPE, (8, 8), interleaved=True)


def test_get_mrope_shares_one_instance():
    assert get_mrope(HEAD_DIM, 64, ROPE, [4, 6, 6]) is get_mrope(HEAD_DIM, 64, ROPE, (4, 6, 6))
    assert get_mrope(HEAD_DIM, 64, ROPE, (4, 6, 6)) is not get_mrope(HEAD_DIM, 64, ROPE, (4, 6, 6), True)
