"""Which attention backend a setting means on which device, and the errors that name what is missing."""
import importlib.util
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tpengine import LLM
from tpengine.attention import make_backend, resolve_backend_name
from tpengine.kernels.cpu import paged_decode_attention as cpu_paged_attention
from tpengine.kernels.cpu.build import has_compiler

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device object only: no GPU is touched
HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.mark.skipif(not has_compiler(), reason="no C++ compiler here")
def test_auto_on_cpu_is_the_cpu_kernel():
    assert resolve_backend_name("auto", CPU, 256) == "cpu"
    assert resolve_backend_name("auto", CPU, 16, torch.float32) == "cpu"


@pytest.mark.skipif(not has_compiler(), reason="no C++ compiler here")
@pytest.mark.parametrize("len_k, features, kernel", [
    (100, {}, True), (512, dict(sliding_window=64), True),  # plain or windowed, over at most 512 keys: the kernel
    (513, {}, False), (100, dict(logit_softcap=5.0), False),  # more keys, or a soft cap: SDPA
], ids=["short", "window", "long", "softcap"])
def test_cpu_prompt_chunks_run_the_prefill_kernel_over_at_most_512_keys(monkeypatch, len_k, features, kernel):
    from tests.kernels.test_cpu_prefill_attention import reference
    from tpengine.attention.backend import AttentionParams
    from tpengine.attention.cpu_backend import KERNEL_MAX_KEYS
    from tpengine.kernels.cpu import prefill_attention
    calls = []
    run = prefill_attention.prefill_attention
    monkeypatch.setattr(prefill_attention, "prefill_attention", lambda *a, **k: calls.append(1) or run(*a, **k))
    q, k, v = torch.randn(20, 4, 32), torch.randn(len_k, 2, 32), torch.randn(len_k, 2, 32)
    params = AttentionParams(scale=0.2, **features)
    out = torch.empty_like(q)
    make_backend("cpu").attend_chunk(q, k, v, 0, params, None, out)
    assert bool(calls) == kernel and KERNEL_MAX_KEYS == 512
    if not features.get("logit_softcap"):
        expected = reference(q, k, v, 0.2, features.get("sliding_window", 0)).float()
        assert (out - expected).abs().max() / expected.abs().max() < 1e-5


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    """A machine with no C++ compiler and no earlier build of the CPU kernel."""
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("TPENGINE_CACHE_DIR", str(tmp_path))
    cpu_paged_attention.load.cache_clear()
    yield
    cpu_paged_attention.load.cache_clear()


def test_auto_on_cpu_without_a_compiler_falls_back_to_torch_and_says_why(no_compiler, caplog):
    with caplog.at_level(logging.WARNING, logger="tpengine"):
        assert resolve_backend_name("auto", CPU, 256) == "torch"
    assert "no-such-compiler" in caplog.text and "using 'torch'" in caplog.text


def test_cpu_backend_without_a_compiler_raises_naming_the_compiler(no_compiler):
    with pytest.raises(ValueError, match="attention_backend='cpu'.*no-such-compiler"):
        resolve_backend_name("cpu", CPU, 256)


@pytest.mark.skipif(not has_compiler(), reason="no C++ compiler here")
def test_auto_on_cpu_with_an_unusable_cache_folder_falls_back_to_torch(monkeypatch, tmp_path, caplog):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    monkeypatch.setenv("TPENGINE_CACHE_DIR", str(not_a_folder))
    cpu_paged_attention.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="tpengine"):
            assert resolve_backend_name("auto", CPU, 256) == "torch"
    finally:
        cpu_paged_attention.load.cache_clear()
    assert str(not_a_folder) in caplog.text


def test_cpu_backend_on_cuda_raises():
    with pytest.raises(ValueError, match="attention_backend='cpu' runs on the CPU"):
        resolve_backend_name("cpu", CUDA, 256)


@pytest.mark.parametrize("block_size", [16, 256])
def test_flash_attn_without_cuda_names_cuda(block_size):
    with pytest.raises(ValueError, match="CUDA"):
        resolve_backend_name("flash_attn", CPU, block_size)


def test_flash_attn_with_block_size_16_names_256():
    with pytest.raises(ValueError, match="multiple of 256.*got 16"):
        resolve_backend_name("flash_attn", CUDA, 16, torch.bfloat16)


def test_flash_attn_in_float32_names_the_half_dtypes():
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        resolve_backend_name("flash_attn", CUDA, 256, torch.float32)


def test_flash_attn_names_its_widest_head_against_a_latent_cache_s():
    with pytest.raises(ValueError, match="heads up to 256 wide, and the model's cached heads are 576"):
        resolve_backend_name("flash_attn", CUDA, 256, torch.bfloat16, head_dim=576)


@pytest.fixture
def flash_attn_installed(monkeypatch):
    """As if flash-attn were installed, so the block-size and dtype rules are what decides."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: object() if name == "flash_attn" else find_spec(name, *args))


def test_auto_on_cuda_picks_flash_attn_where_it_can_run(flash_attn_installed):
    assert resolve_backend_name("auto", CUDA, 256, torch.bfloat16) == "flash_attn"


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("block_size, dtype", [(16, torch.bfloat16), (256, torch.float32)])
def test_auto_on_cuda_falls_back_to_triton_where_flash_attn_cannot_run(block_size, dtype, flash_attn_installed):
    assert resolve_backend_name("auto", CUDA, block_size, dtype) == "triton"


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_auto_on_cuda_takes_triton_for_a_latent_cache(flash_attn_installed):
    assert resolve_backend_name("auto", CUDA, 256, torch.bfloat16, head_dim=576) == "triton"


@pytest.fixture
def triton_without_knobs(monkeypatch):
    """As if the installed Triton were older than 3.4: `from triton import knobs` fails."""
    import triton
    monkeypatch.delattr(triton, "knobs")
    monkeypatch.setitem(sys.modules, "triton.knobs", None)


@pytest.fixture
def no_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_triton_older_than_3_4_raises_naming_the_version(triton_without_knobs):
    with pytest.raises(ValueError, match=r"attention_backend='triton' needs triton >= 3\.4.*found"):
        resolve_backend_name("triton", CUDA, 16, torch.float32)


def test_triton_missing_raises_naming_the_package(no_triton):
    with pytest.raises(ValueError, match="attention_backend='triton' needs the triton package"):
        resolve_backend_name("triton", CUDA, 16, torch.float32)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("broken", ["triton_without_knobs", "no_triton"])
def test_auto_on_cuda_without_a_usable_triton_falls_back_to_torch_and_says_why(broken, request, caplog):
    request.getfixturevalue(broken)
    with caplog.at_level(logging.WARNING, logger="tpengine"):
        assert resolve_backend_name("auto", CUDA, 16, torch.bfloat16) == "torch"
    assert "attention backend 'triton' needs" in caplog.text


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_triton_on_cpu_without_the_interpreter_raises_naming_it(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="attention_backend='triton' runs on the CPU only in .*TRITON_INTERPRET=1"):
        resolve_backend_name("triton", CPU, 16, torch.float32)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend_name("triton", CPU, 16, torch.float32) == "triton"


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_llm_asking_for_triton_on_cpu_without_the_interpreter_raises(tiny_model, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        LLM(tiny_model, attention_backend="triton", device="cpu")


# Run in a fresh interpreter: flash_attn is a stand-in (its kernels need CUDA), Triton is hidden or
# not, and the real store runs on CPU tensors. With Triton, only its store kernel may be imported:
# the attention kernels' module reads triton.knobs, which a Triton older than 3.4 lacks.
FLASH_ATTN_IMPORT = textwrap.dedent("""
    import sys, types
    import torch
    if sys.argv[1] == "no_triton":
        sys.modules["triton"] = None
    sys.modules["flash_attn"] = types.SimpleNamespace(flash_attn_varlen_func=None, flash_attn_with_kvcache=None)
    from tpengine.attention.flash_attn_backend import FlashAttnBackend
    assert "tpengine.kernels.triton.paged_attention_tile" not in sys.modules
    k = torch.arange(3 * 2 * 4, dtype=torch.float32).view(3, 2, 4)
    k_cache, v_cache = torch.zeros(2, 16, 2, 4), torch.zeros(2, 16, 2, 4)
    FlashAttnBackend().store_kvcache(k, -k, k_cache, v_cache, torch.tensor([17, -1, 0]))
    assert torch.equal(k_cache[1, 1], k[0]) and torch.equal(v_cache[0, 0], -k[2])
    assert k_cache.count_nonzero() == k[0].count_nonzero() + k[2].count_nonzero()  # the -1 row stored nothing
    print("graph safe" if FlashAttnBackend.cuda_graph_safe else "eager")
""")


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("triton_state, decode", [("no_triton", "eager"), ("triton", "graph safe")])
def test_flash_attn_backend_needs_only_the_triton_store_kernel_or_no_triton(triton_state, decode):
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # with Triton, its store kernel runs on CPU
    result = subprocess.run([sys.executable, "-c", FLASH_ATTN_IMPORT, triton_state], capture_output=True,
                            text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == decode.split()


def test_unknown_backend_name_raises():
    with pytest.raises(ValueError, match="unknown attention backend"):
        make_backend("cudnn")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_llm_asking_for_flash_attn_on_cpu_raises_naming_cuda(tiny_model):
    with pytest.raises(ValueError, match="CUDA"):
        LLM(tiny_model, attention_backend="flash_attn")
