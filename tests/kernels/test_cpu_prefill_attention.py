"""The C++ prefill attention (kernels/cpu/prefill_attention.cpp) against a float64 reference: fresh prompts and
chunks over a cached prefix, GQA groups, sliding windows, head dims of one to eight vectors, key runs across its
key blocks and work items, bfloat16 and float16, queries that are views of a fused projection, and on one thread
and two (its work items are split among them)."""
import pytest
import torch

from tests.conftest import relative_error
from tpengine.kernels.cpu import prefill_attention as kernel
from tpengine.kernels.cpu.build import has_compiler

pytestmark = pytest.mark.skipif(not has_compiler(), reason="the kernel needs a C++ compiler")

WIDTH = kernel.vector_width()


def reference(q, k, v, scale, window=0):
    """Causal (within the window) attention in float64; q holds the last len(q) of len(k) positions."""
    len_q, len_k = q.size(0), k.size(0)
    query_pos = torch.arange(len_k - len_q, len_k)[:, None]
    key_pos = torch.arange(len_k)[None, :]
    mask = key_pos <= query_pos
    if window:
        mask &= key_pos > query_pos - window
    group = q.size(1) // k.size(1)
    keys, values = (t.double().repeat_interleave(group, 1).transpose(0, 1) for t in (k, v))
    scores = (q.double().transpose(0, 1) @ keys.transpose(1, 2)) * scale
    return (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ values).transpose(0, 1)


CASES = [  # len_q, len_k, heads, kv_heads, head_dim (in vectors), window
    (256, 256, 4, 2, 2, 0),
    (1, 1, 2, 1, 1, 0),
    (5, 300, 4, 2, 2, 0),      # a short chunk after a cached prefix
    (130, 400, 8, 2, 4, 50),   # a chunk after a prefix, in a window narrower than the chunk
    (77, 77, 6, 3, 8, 0),
    (300, 700, 4, 4, 3, 129),  # no GQA, a window one past a key block
    (97, 97, 7, 1, 1, 0),      # one KV head for seven query heads: rows not a multiple of the tile's four
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_float32_equals_the_float64_reference(case, threads):
    len_q, len_k, heads, kv_heads, vectors, window = case
    head_dim = vectors * WIDTH
    generator = torch.Generator().manual_seed(len_q * 31 + len_k)
    q = torch.randn(len_q, heads, head_dim, generator=generator)
    k, v = (torch.randn(len_k, kv_heads, head_dim, generator=generator) for _ in range(2))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = kernel.prefill_attention(q, k, v, head_dim ** -0.5, window)
    finally:
        torch.set_num_threads(previous)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert relative_error(out, reference(q, k, v, head_dim ** -0.5, window).float()) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes_compute_in_float32(dtype):
    head_dim = 2 * WIDTH
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(40, 4, head_dim, generator=generator).to(dtype)
    k, v = (torch.randn(90, 2, head_dim, generator=generator).to(dtype) for _ in range(2))
    out = kernel.prefill_attention(q, k, v, 0.3, 16)
    expected = reference(q.float(), k.float(), v.float(), 0.3, 16)
    assert out.dtype == dtype
    assert torch.equal(out, expected.to(dtype)) or relative_error(out.float(), expected.float()) < 1e-2


def test_queries_keys_and_values_as_views_of_one_projection():
    heads, kv_heads, head_dim, tokens = 4, 2, 2 * WIDTH, 70
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)
    out = kernel.prefill_attention(q, k, v, 0.5)
    assert relative_error(out, reference(q, k, v, 0.5).float()) < 1e-5


@pytest.mark.parametrize("shapes, message", [
    (((4, 2, WIDTH), (3, 2, WIDTH)), "len_k >= len_q"),
    (((4, 3, WIDTH), (4, 2, WIDTH)), "multiple of the KV heads"),
    (((4, 2, WIDTH + 1), (4, 2, WIDTH + 1)), "multiple of"),
], ids=["fewer keys", "heads", "head_dim"])
def test_shapes_it_cannot_run_are_refused_by_name(shapes, message):
    q_shape, k_shape = shapes
    with pytest.raises(RuntimeError, match=message):
        kernel.prefill_attention(torch.randn(q_shape), torch.randn(k_shape), torch.randn(k_shape), 1.0)


def test_takes_says_which_queries_it_runs():
    assert kernel.takes(torch.randn(3, 2, 2 * WIDTH))
    assert not kernel.takes(torch.randn(3, 2, WIDTH + 1))  # head_dim off the vector width
    assert not kernel.takes(torch.randn(3, 2, 2 * WIDTH, dtype=torch.float64))


@pytest.fixture(scope="module", params=[("-mno-avx512f",), ("-mno-avx512f", "-mno-avx2", "-mno-fma")],
                ids=["avx2", "scalar"])
def narrower_build(request, tmp_path_factory):
    """The kernel built for a narrower CPU than this one (AVX2: 8-float vectors; none: 4, std::exp), under its own
    op namespace beside the native build: (the op, its vector width)."""
    import os
    import subprocess

    from tpengine.kernels.cpu.build import FOLDER, _compile_command, compiler_name

    name = "tpengine_prefill_" + request.param[-1].replace("-", "_").strip("_")
    folder = tmp_path_factory.mktemp(name)
    cpp, library = str(folder / "prefill_attention.cpp"), str(folder / "prefill_attention.so")
    with open(os.path.join(FOLDER, "prefill_attention.cpp")) as f:
        source = f.read()
    with open(cpp, "w") as f:
        f.write(source.replace("tpengine_prefill", name))
    subprocess.run(_compile_command(compiler_name(), cpp, library, request.param), check=True, capture_output=True)
    torch.ops.load_library(library)
    return getattr(torch.ops, name).prefill_attention, 8 if len(request.param) == 1 else 4


@pytest.mark.parametrize("case", [CASES[2], CASES[3], CASES[6]], ids=str)
def test_the_narrower_vector_builds_equal_the_reference(narrower_build, case):
    op, width = narrower_build
    len_q, len_k, heads, kv_heads, vectors, window = case
    head_dim = vectors * width
    generator = torch.Generator().manual_seed(len_q + len_k)
    q = torch.randn(len_q, heads, head_dim, generator=generator)
    k, v = (torch.randn(len_k, kv_heads, head_dim, generator=generator) for _ in range(2))
    out = torch.empty_like(q)
    op(out, q, k, v, head_dim ** -0.5, window)
    assert relative_error(out, reference(q, k, v, head_dim ** -0.5, window).float()) < 1e-5


def test_out_is_written_in_place_when_given():
    head_dim = 2 * WIDTH
    q, k, v = torch.randn(9, 4, head_dim), torch.randn(12, 2, head_dim), torch.randn(12, 2, head_dim)
    rows = torch.full((20, 4, head_dim), 5.0)
    out = kernel.prefill_attention(q, k, v, 0.2, out=rows[3:12])
    assert out.data_ptr() == rows[3:12].data_ptr()
    assert relative_error(rows[3:12], reference(q, k, v, 0.2).float()) < 1e-5
    assert rows[:3].eq(5).all() and rows[12:].eq(5).all()
