"""An FP8 (e4m3) KV cache in the attention backends: the torch backend against the float64 reference over the
dequantized keys, the Triton backend against the torch backend (the same bits stored), and which backends take it."""
import dataclasses
import logging

import pytest
import torch

from tests.attention.paged_batch import forward_each, mixed_batch, paged_batch, reference_attention
from tests.conftest import relative_error
from tpengine.attention import resolve_backend_name
from tpengine.attention.kv_cache_dtype import FP8, dequantize_kv, quantize_kv
from tpengine.attention.torch_backend import TorchAttentionBackend

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device object only: no GPU is touched
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
K_SCALE, V_SCALE = 0.37, 1.9


def fp8_batch(batch):
    """The batch with an FP8 cache (its prefixes and garbage quantized), the layer's scales, and the reference's
    keys and values as the cache gives them back."""
    device = batch.q.device
    k_scale = torch.tensor([K_SCALE], device=device)
    v_scale = torch.tensor([V_SCALE], device=device)
    batch.k_cache, batch.v_cache = quantize_kv(batch.k_cache, k_scale), quantize_kv(batch.v_cache, v_scale)
    batch.params = dataclasses.replace(batch.params, k_scale=k_scale, v_scale=v_scale)
    batch.keys = [dequantize_kv(quantize_kv(k, k_scale), k_scale, k.dtype) for k in batch.keys]
    batch.values = [dequantize_kv(quantize_kv(v, v_scale), v_scale, v.dtype) for v in batch.values]
    return batch


def bits(cache):
    return cache.view(torch.uint8)


@pytest.mark.parametrize("batch", [
    lambda: paged_batch([(0, 5), (16, 5), (20, 7)], seed=1),  # fresh, block-aligned prefix, mid-block chunk
    lambda: paged_batch([(0, 1), (15, 1), (39, 1)], decode=True, seed=2),
    lambda: mixed_batch([(15, 1), (0, 6), (20, 3)], num_decode=1, seed=3),
    lambda: paged_batch([(0, 1), (39, 1)], decode=True, seed=4, softcap=3.0, sinks=True),  # its general decode
], ids=["prefill", "decode", "mixed", "decode_softcap_sinks"])
def test_torch_backend_matches_reference_over_the_dequantized_keys(batch):
    batch = fp8_batch(batch())
    (out, k_cache, _), = forward_each(batch, TorchAttentionBackend())
    assert k_cache.dtype == FP8
    assert relative_error(out, reference_attention(batch)) < 1e-5


@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_triton_backend_stores_the_same_bits_and_attends_as_the_torch_backend(decode):
    pytest.importorskip("triton")
    from tpengine.attention.triton_backend import TritonAttentionBackend
    seqs = [(0, 1), (16, 1), (37, 1)] if decode else [(0, 5), (20, 7)]
    batch = fp8_batch(paged_batch(seqs, decode=decode, head_dim=48, device=DEVICE, seed=5))
    (ref, ref_k, ref_v), (out, k_cache, v_cache) = forward_each(batch, TorchAttentionBackend(),
                                                                TritonAttentionBackend())
    assert torch.equal(bits(k_cache), bits(ref_k)) and torch.equal(bits(v_cache), bits(ref_v))
    assert relative_error(out, ref) < 1e-4


def test_auto_on_cpu_takes_the_torch_backend_and_says_why(caplog):
    with caplog.at_level(logging.INFO, logger="tpengine"):
        assert resolve_backend_name("auto", CPU, 16, torch.float32, FP8) == "torch"
    assert "C++ decode kernel has no FP8 KV cache" in caplog.text


@pytest.mark.parametrize("name, device", [("cpu", CPU), ("flash_attn", CUDA)])
def test_backends_without_fp8_raise_naming_those_with_it(name, device):
    with pytest.raises(ValueError, match=f"attention_backend='{name}' has no FP8 KV cache.*'triton' or 'torch'"):
        resolve_backend_name(name, device, 256, torch.bfloat16, FP8)


@pytest.fixture
def gpu_capability(monkeypatch):
    """As if the GPU had this compute capability (no GPU is touched)."""
    def set_capability(capability):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    return set_capability


def test_auto_on_an_h100_takes_triton_for_fp8(gpu_capability):
    pytest.importorskip("triton")
    gpu_capability((9, 0))
    assert resolve_backend_name("auto", CUDA, 256, torch.bfloat16, FP8) == "triton"


def test_triton_on_an_a100_raises_naming_the_capability_and_auto_takes_torch(gpu_capability, caplog):
    pytest.importorskip("triton")
    gpu_capability((8, 0))
    with pytest.raises(ValueError, match=r"attention_backend='triton' has no FP8 KV cache on this GPU.*8\.0.*8\.9"):
        resolve_backend_name("triton", CUDA, 16, torch.bfloat16, FP8)
    with caplog.at_level(logging.WARNING, logger="tpengine"):
        assert resolve_backend_name("auto", CUDA, 16, torch.bfloat16, FP8) == "torch"
    assert "compute capability 8.0" in caplog.text
