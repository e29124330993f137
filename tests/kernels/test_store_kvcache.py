import pytest
import torch

from tpengine.kernels.triton.store_kvcache import store_kvcache

pytestmark = pytest.mark.usefixtures("triton_device")


@pytest.mark.parametrize(
    "block_size, num_kv_heads, head_dim, slot_dtype, dtype",
    [
        (16, 2, 64, torch.int32, torch.float32),
        (32, 1, 48, torch.int64, torch.float32),
        (256, 4, 96, torch.int64, torch.float16),
    ],
)
def test_store_kvcache(block_size, num_kv_heads, head_dim, slot_dtype, dtype):
    num_blocks, num_tokens = 4, 7
    # key/value as strided views into a fused qkv-like buffer, like a real QKV projection split.
    fused = torch.randn(num_tokens, num_kv_heads, 3 * head_dim, dtype=dtype)
    key, value = fused[..., :head_dim], fused[..., 2 * head_dim :]
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[[1, 4]] = -1  # padding tokens
    slot_mapping = slots.to(slot_dtype)

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    store_kvcache(key, value, k_cache, v_cache, slot_mapping)

    written = slots >= 0
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    assert torch.equal(k_flat[slots[written]], key[written])
    assert torch.equal(v_flat[slots[written]], value[written])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[written]] = False
    assert k_flat[untouched].isnan().all() and v_flat[untouched].isnan().all()
