"""Which attention backend a setting means on which device, and the errors that name what is missing."""
import importlib.util
import logging

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


def test_unknown_backend_name_raises():
    with pytest.raises(ValueError, match="unknown attention backend"):
        make_backend("cudnn")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_llm_asking_for_flash_attn_on_cpu_raises_naming_cuda(tiny_model):
    with pytest.raises(ValueError, match="CUDA"):
        LLM(tiny_model, attention_backend="flash_attn")
