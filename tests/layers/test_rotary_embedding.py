"""Rotary embedding: both apply forms give transformers' values; the CUDA form traces as one graph."""
import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

from tpengine.hf_config import RopeParameters
from tpengine.layers.rotary_embedding import RotaryEmbedding
from tpengine.platforms.torch_ops import apply_rotary_in_halves, apply_rotary_pointwise

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def qkv_views(num_tokens: int, dtype=torch.float32, device="cpu", seed=0):
    """q and k as the model hands them over: strided views into one qkv projection output."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g).to(dtype=dtype, device=device)
    q, k, _ = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    return q.view(num_tokens, HEADS, HEAD_DIM), k.view(num_tokens, KV_HEADS, HEAD_DIM)


def transformers_rotary(positions, q, k, cos_sin_cache):
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], dim=-1)[None], torch.cat([sin, sin], dim=-1)[None]  # [1, tokens, head_dim]
    q_embed, k_embed = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    return q_embed[0].transpose(0, 1), k_embed[0].transpose(0, 1)


def test_cpu_and_cuda_forms_equal_transformers_exactly_in_float32():
    cache = RotaryEmbedding(HEAD_DIM, 512, RopeParameters(theta=10_000.0)).cos_sin_cache
    positions = torch.tensor([0, 1, 7, 300, 511, 3])
    q, k = qkv_views(len(positions))
    expected = transformers_rotary(positions, q, k, cache)
    in_place = apply_rotary_in_halves(positions, q, k, cache)  # the CPU form
    traceable = apply_rotary_pointwise(positions, q, k, cache)  # the CUDA form, uncompiled
    for ours in (in_place, traceable):
        assert all(torch.equal(a, b) for a, b in zip(ours, expected))


def test_cuda_form_traces_as_one_graph_without_a_break():
    cache = RotaryEmbedding(HEAD_DIM, 512, RopeParameters(theta=10_000.0)).cos_sin_cache
    positions = torch.arange(5)
    explanation = torch._dynamo.explain(apply_rotary_pointwise)(positions, *qkv_views(5), cache)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_cuda_form_equals_the_cpu_form_in_at_most_two_kernels(dtype):
    from torch._inductor.utils import run_and_get_code
    torch._dynamo.reset()  # compile afresh here, so the generated code comes back
    cache = RotaryEmbedding(HEAD_DIM, 512, RopeParameters(theta=10_000.0)).cos_sin_cache
    positions = torch.tensor([0, 9, 200, 33])
    q, k = qkv_views(len(positions), dtype)
    expected = apply_rotary_in_halves(positions, q, k, cache)
    compiled = torch.compile(apply_rotary_pointwise)
    (q_out, k_out), code = run_and_get_code(compiled, positions.cuda(), q.cuda(), k.cuda(), cache.cuda())
    # the same values up to one rounding (the fused kernel may contract a multiply-add)
    torch.testing.assert_close(q_out.cpu(), expected[0])
    torch.testing.assert_close(k_out.cpu(), expected[1])
    num_kernels = sum(source.count("@triton.jit") for source in code)
    assert 1 <= num_kernels <= 2, f"rotary compiled into {num_kernels} kernels, not one or two"
