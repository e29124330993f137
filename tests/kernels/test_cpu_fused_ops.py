"""The fused CPU ops (kernels/cpu/fused_ops.cpp) against the torch code they replace, which is also the
CPU platform's fallback where no compiler builds them.

Bitwise where the op does the same arithmetic in the same order: the residual add, the rotary
embedding, SiLU-and-mul (float32, when this build's exp has torch's vector width) and the KV store.
The RMSNorms sum their squares in another order than torch's reduction, so the normed values may differ
in the last bit: float32 within a few ulp, the half types within one rounding of their own.
"""
import pytest
import torch

from tpengine.kernels.cpu import fused_ops
from tpengine.kernels.cpu.build import has_compiler
from tpengine.platforms.torch_ops import (add_rms_norm, apply_rotary_in_halves, rms_norm, silu_and_mul,
                                          store_kvcache_masked)

pytestmark = pytest.mark.skipif(not has_compiler(), reason="no C++ compiler here")

HALF_DTYPES = (torch.bfloat16, torch.float16)
# one rounding of the dtype (the norm's inverse may differ in float32's last bit before rounding)
NORM_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=1e-2, atol=1e-2),
            torch.float16: dict(rtol=2e-3, atol=2e-3)}


def _randn(*shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", fused_ops.DTYPES)
@pytest.mark.parametrize("rows, hidden", [(1, 512), (7, 64), (300, 96)])
def test_rms_norm_matches_torch(dtype, rows, hidden):
    x, weight = _randn(rows, hidden, dtype=dtype), _randn(hidden, dtype=dtype, seed=1)
    torch.testing.assert_close(fused_ops.rms_norm(x, weight, 1e-6), rms_norm(x, weight, 1e-6), **NORM_TOL[dtype])


@pytest.mark.parametrize("dtype", fused_ops.DTYPES)
@pytest.mark.parametrize("rows, hidden", [(1, 512), (300, 96)])
def test_add_rms_norm_writes_both_in_place_and_matches_torch(dtype, rows, hidden):
    x, residual, weight = _randn(rows, hidden, dtype=dtype), _randn(rows, hidden, dtype=dtype, seed=1), \
        _randn(hidden, dtype=dtype, seed=2)
    expected_out, expected_residual = add_rms_norm(x, residual, weight, 1e-5)
    out, new_residual = fused_ops.add_rms_norm_(x, residual, weight, 1e-5)
    assert out is x and new_residual is residual
    assert torch.equal(new_residual, expected_residual)  # one add, rounded once: the same bits
    torch.testing.assert_close(out, expected_out, **NORM_TOL[dtype])


def _qkv_views(tokens, num_heads, num_kv_heads, head_dim, dtype, seed=0):
    """q, k, v as the decoder has them: strided views of one projection output."""
    qkv = _randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=seed)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return (q.view(tokens, num_heads, head_dim), k.view(tokens, num_kv_heads, head_dim),
            v.view(tokens, num_kv_heads, head_dim))


def _cos_sin_cache(max_position, head_dim):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


@pytest.mark.parametrize("dtype", fused_ops.DTYPES)
@pytest.mark.parametrize("head_dim", [64, 48])
def test_rotary_alone_matches_torch_bitwise(dtype, head_dim):
    q, k, _ = _qkv_views(5, 4, 2, head_dim, dtype)
    positions = torch.tensor([0, 3, 99, 7, 1])
    cache = _cos_sin_cache(100, head_dim)
    expected_q, expected_k = apply_rotary_in_halves(positions, q, k, cache)
    out_q, out_k = fused_ops.qk_norm_rotary_(q, k, None, None, 0.0, positions, cache)
    assert out_q is q and out_k is k  # in place, in the projection's output
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)


@pytest.mark.parametrize("dtype", fused_ops.DTYPES)
def test_qk_norm_then_rotary_matches_torch(dtype):
    q, k, v = _qkv_views(6, 8, 4, 64, dtype)
    v_before = v.clone()
    q_weight, k_weight = _randn(64, dtype=dtype, seed=1), _randn(64, dtype=dtype, seed=2)
    positions, cache = torch.arange(6) * 5, _cos_sin_cache(64, 64)
    expected_q, expected_k = apply_rotary_in_halves(positions, rms_norm(q, q_weight, 1e-6), rms_norm(k, k_weight, 1e-6),
                                                  cache)
    fused_ops.qk_norm_rotary_(q, k, q_weight, k_weight, 1e-6, positions, cache)
    torch.testing.assert_close(q, expected_q, **NORM_TOL[dtype])
    torch.testing.assert_close(k, expected_k, **NORM_TOL[dtype])
    assert torch.equal(v, v_before)  # v shares the buffer: untouched


def test_a_position_outside_the_rotary_cache_is_an_error():
    q, k, _ = _qkv_views(2, 2, 1, 16, torch.float32)
    with pytest.raises(RuntimeError, match="position 8 is outside the rotary cache's 0..7"):
        fused_ops.qk_norm_rotary_(q, k, None, None, 0.0, torch.tensor([0, 8]), _cos_sin_cache(8, 16))


@pytest.mark.parametrize("dtype", fused_ops.DTYPES)
@pytest.mark.parametrize("rows, d", [(1, 1024), (3, 1000), (33, 24)])  # 1000, 24: a scalar tail after the vectors
def test_silu_and_mul_matches_torch(dtype, rows, d):
    x = _randn(rows, 2 * d, dtype=dtype) * 4
    expected = silu_and_mul(x)
    out = fused_ops.silu_and_mul(x)
    same_exp = (fused_ops.exp_isa().upper() == torch.backends.cpu.get_cpu_capability()
                or fused_ops.exp_isa() == "scalar" and torch.backends.cpu.get_cpu_capability() == "DEFAULT")
    if dtype == torch.float32 and same_exp:  # torch's exp at torch's width: the same bits
        assert torch.equal(out, expected)
    else:
        torch.testing.assert_close(out, expected, **NORM_TOL[dtype])


@pytest.mark.parametrize("dtype", fused_ops.DTYPES)
def test_store_kvcache_matches_torch_and_skips_padding(dtype):
    _, k, v = _qkv_views(4, 2, 2, 32, dtype)
    slot_mapping = torch.tensor([5, -1, 16, 0])
    caches = [torch.full((3, 8, 2, 32), float("nan"), dtype=dtype) for _ in range(4)]
    store_kvcache_masked(k, v, caches[0], caches[1], slot_mapping)
    fused_ops.store_kvcache(k, v, caches[2], caches[3], slot_mapping)
    assert torch.equal(caches[2].nan_to_num(7.0), caches[0].nan_to_num(7.0))
    assert torch.equal(caches[3].nan_to_num(7.0), caches[1].nan_to_num(7.0))


def test_store_kvcache_rejects_a_slot_outside_the_cache():
    k = v = torch.zeros(1, 1, 8)
    cache = torch.zeros(2, 4, 1, 8)
    with pytest.raises(RuntimeError, match="slot 8 of token 0 is outside the cache's 8 slots"):
        fused_ops.store_kvcache(k, v, cache, cache.clone(), torch.tensor([8]))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch fallback"])
def test_greedy_tokens_match_transformers_with_and_without_the_fused_ops(tiny_model, monkeypatch, fused):
    """The CPU platform takes the fused ops where they are built, the torch code where not: both give
    transformers' tokens (Qwen3: q/k norm, rotary, residual norms, SiLU, the KV store all on the path)."""
    from tests.conftest import hf_greedy, random_prompts
    from tpengine import LLM, SamplingParams

    if not fused:
        monkeypatch.setattr(fused_ops, "available", lambda: False)
    prompts = random_prompts(3, [1, 17, 90], 1003)
    with LLM(tiny_model, attention_backend="cpu", kvcache_block_size=16) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [out.token_ids for out in outputs] == hf_greedy(tiny_model, prompts, 8)
