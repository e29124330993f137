"""This rank's KV cache: its blocks' size over every model that reads them, the views each attention layer gets,
block copies, and how many blocks every rank agrees to hold."""
import os

import pytest
import torch
from torch import nn

from tpengine.config import EngineConfig
from tpengine.distributed.messages import BlockCopy
from tpengine.runner.kv_cache import KVCache, num_kvcache_blocks

CPU = torch.device("cpu")


class Attention(nn.Module):
    """What the cache asks of an attention layer: its K/V heads and head size, and a k_cache/v_cache to set."""

    def __init__(self, num_kv_heads: int, head_dim: int, values_are_keys: bool = False):
        super().__init__()
        self.num_kv_heads, self.head_dim, self.values_are_keys = num_kv_heads, head_dim, values_are_keys
        self.k_cache = self.v_cache = torch.tensor([])


def layers(count: int, num_kv_heads: int = 2, head_dim: int = 4) -> list[Attention]:
    return [Attention(num_kv_heads, head_dim) for _ in range(count)]


def test_a_block_holds_the_model_and_the_draft_model_k_and_v():
    cache = KVCache([layers(3), layers(1, num_kv_heads=1)], block_size=16, dtype=torch.bfloat16, device=CPU)
    assert cache.block_bytes == (3 * 16 * 2 * 2 * 4 + 1 * 16 * 2 * 1 * 4) * 2


def test_a_latent_cache_holds_one_tensor_whose_values_are_its_keys():
    latent_layers = [Attention(1, 32 + 8, values_are_keys=True) for _ in range(3)]  # DeepSeek's latent + rotary key
    cache = KVCache([latent_layers], block_size=16, dtype=torch.bfloat16, device=CPU)
    assert cache.block_bytes == 3 * 16 * 40 * 2  # one 40-wide vector per token and layer, no second tensor
    cache.allocate(4)
    assert tuple(cache.tensors[0].shape) == (1, 3, 4, 16, 1, 40)
    assert all(layer.v_cache.data_ptr() == layer.k_cache.data_ptr() for layer in latent_layers)


def test_each_layer_reads_its_own_rows_of_one_tensor_until_it_is_freed():
    model_layers, draft_layers = layers(2), layers(1)
    cache = KVCache([model_layers, draft_layers], block_size=4, dtype=torch.float32, device=CPU)
    cache.allocate(5)
    assert [tuple(t.shape) for t in cache.tensors] == [(2, 2, 5, 4, 2, 4), (2, 1, 5, 4, 2, 4)]
    model_layers[1].v_cache.fill_(7.0)
    assert torch.equal(cache.tensors[0][1, 1], model_layers[1].v_cache) and cache.tensors[0][1, 1].eq(7).all()
    assert draft_layers[0].k_cache.data_ptr() == cache.tensors[1][0, 0].data_ptr()
    cache.free()
    assert [t.numel() for t in cache.tensors] == [0, 0]
    assert all(layer.k_cache.numel() == layer.v_cache.numel() == 0 for layer in model_layers + draft_layers)


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident size from /proc")
def test_map_pages_makes_a_host_cache_resident_at_once():
    model_layers, draft_layers = layers(4, head_dim=64), layers(1, head_dim=64)
    cache = KVCache([model_layers, draft_layers], block_size=256, dtype=torch.float32, device=CPU)
    cache.allocate(64)  # 5 layers x 2 x 64 blocks x 256 x 2 x 64 floats: 80 MiB, none of it touched yet
    size = sum(t.numel() * t.element_size() for t in cache.tensors)
    before = resident_bytes()
    cache.map_pages()
    assert resident_bytes() - before > 0.9 * size
    assert all(t.eq(0).all() for t in cache.tensors)


def test_a_block_copy_copies_the_head_of_a_block_in_every_models_cache():
    cache = KVCache([layers(2), layers(1)], block_size=4, dtype=torch.float32, device=CPU)
    cache.allocate(3)
    for tensor in cache.tensors:
        tensor.copy_(torch.arange(tensor.numel(), dtype=torch.float32).view_as(tensor))
    before = [tensor.clone() for tensor in cache.tensors]
    cache.copy_blocks([BlockCopy(src=0, dst=2, num_tokens=3)])
    for tensor, old in zip(cache.tensors, before):
        assert torch.equal(tensor[:, :, 2, :3], old[:, :, 0, :3])
        assert torch.equal(tensor[:, :, 2, 3:], old[:, :, 2, 3:])  # past the head: the block's own
        assert torch.equal(tensor[:, :, :2], old[:, :, :2])


def config(**settings) -> EngineConfig:
    return EngineConfig(model="unused", max_num_seqs=4, max_model_len=64, kvcache_block_size=16, **settings)


def test_every_rank_holds_the_fewest_blocks_any_rank_can():
    other_ranks_can = 3
    agreed = num_kvcache_blocks(config(num_kvcache_blocks=10), CPU, block_bytes=1024, activation_peak_bytes=0,
                                max_num_blocks_per_seq=4, all_ranks_min=lambda value: min(value, other_ranks_can))
    assert agreed == 3


def test_no_more_blocks_than_max_num_seqs_sequences_of_max_model_len_can_use():
    agreed = num_kvcache_blocks(config(), CPU, block_bytes=1024, activation_peak_bytes=0, max_num_blocks_per_seq=4,
                                all_ranks_min=lambda value: value)
    assert agreed == 4 * 4


def test_blocks_asked_beyond_the_hosts_memory_are_a_value_error_naming_the_setting():
    agreed = []
    with pytest.raises(ValueError, match=r"num_kvcache_blocks=1000000 needs a KV cache of [\d.]+ GiB per rank"):
        num_kvcache_blocks(config(num_kvcache_blocks=10**6), CPU, block_bytes=1 << 30, activation_peak_bytes=0,
                           max_num_blocks_per_seq=4, all_ranks_min=lambda value: agreed.append(value) or value)
    assert agreed == [0]  # the other ranks learn of it and fail too


def test_a_rank_with_no_room_for_a_block_fails_every_rank():
    with pytest.raises(ValueError, match="no room for a single KV-cache block of 1024 bytes on every rank"):
        num_kvcache_blocks(config(num_kvcache_blocks=2), CPU, block_bytes=1024, activation_peak_bytes=0,
                           max_num_blocks_per_seq=4, all_ranks_min=lambda value: 0)
