"""This rank's KV cache: how many blocks fit on its device, and the tensors that hold them.

The model's K/V and a draft model's (runner/drafter.py) live in the same blocks: the ledger's block tables and
block copies serve both, so a block's bytes are both models' and every tensor is allocated, freed and copied
together. Every rank holds the same number of blocks: the smallest any rank can hold.
"""
import os
from collections.abc import Callable

import torch

from tpengine.config import EngineConfig
from tpengine.distributed.messages import BlockCopy

DEFAULT_CPU_KVCACHE_GB = 4.0


def available_host_memory() -> int:
    """Bytes the host can still hand out without swapping (Linux MemAvailable; free pages elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / (1 << 30):.2f} GiB"


def attention_layers_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "k_cache")]


def _tensors_per_layer(layer: torch.nn.Module) -> int:
    """2 for a layer's keys and values; 1 where its values are its keys (a latent cache: models/deepseek.py)."""
    return 1 if layer.values_are_keys else 2


def kv_block_bytes(attention_layers: list[torch.nn.Module], block_size: int, dtype: torch.dtype) -> int:
    layer = attention_layers[0]
    return (len(attention_layers) * block_size * _tensors_per_layer(layer) * layer.num_kv_heads * layer.head_dim
            * dtype.itemsize)


def allocate_kv_cache(attention_layers: list[torch.nn.Module], num_blocks: int, block_size: int,
                      dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One tensor for every layer's K and V, [2, layers, blocks, block_size, kv_heads, head_dim] (one tensor, not 2,
    where values are the keys: v_cache is then k_cache), each layer given its views. CUDA: zeroed once, so no stale
    NaN bit pattern in an unwritten slot reaches a masked-out product (0 * NaN) in the torch backend; CPU: not
    touched here (an engine that warms up maps its pages then: KVCache.map_pages)."""
    layer = attention_layers[0]
    shape = (_tensors_per_layer(layer), len(attention_layers), num_blocks, block_size, layer.num_kv_heads,
             layer.head_dim)
    allocate = torch.zeros if device.type == "cuda" else torch.empty
    kv_cache = allocate(shape, dtype=dtype, device=device)
    for i, layer in enumerate(attention_layers):
        layer.k_cache, layer.v_cache = kv_cache[0, i], kv_cache[-1, i]
    return kv_cache


def free_kv_cache(attention_layers: list[torch.nn.Module]) -> torch.Tensor:
    empty = torch.tensor([])
    for layer in attention_layers:
        layer.k_cache = layer.v_cache = empty
    return empty


class KVCache:
    """One cache tensor per model that reads the blocks (the model's first, then a draft model's), empty until
    allocate()."""

    def __init__(self, attention_layers: list[list[torch.nn.Module]], block_size: int, dtype: torch.dtype,
                 device: torch.device):
        self.attention_layers = attention_layers  # per model, its layers in order
        self.block_size = block_size
        self.dtype = dtype  # the cache's element: 1 byte for FP8
        self.device = device
        # one block's K/V on this rank, every model's
        self.block_bytes = sum(kv_block_bytes(layers, block_size, dtype) for layers in attention_layers)
        self.tensors = [torch.tensor([]) for _ in attention_layers]

    def allocate(self, num_blocks: int) -> None:
        try:
            self.tensors = [allocate_kv_cache(layers, num_blocks, self.block_size, self.dtype, self.device)
                            for layers in self.attention_layers]
        except RuntimeError as e:  # torch.OutOfMemoryError included: the sizing misjudged what is free
            self.free()
            raise ValueError(f"could not allocate a KV cache of {num_blocks} blocks "
                             f"({_gib(num_blocks * self.block_bytes)}) on {self.device}: {e}") from None

    def free(self) -> None:
        self.tensors = [free_kv_cache(layers) for layers in self.attention_layers]

    def map_pages(self) -> None:
        """Write every page of a host cache once (zeros), so that no step pays its first touch: a prompt's first
        write into fresh pages made its step ~0.5-0.9 ms slower on a VM (docs/benchmarks.md); ~0.2 s a GiB."""
        if self.device.type == "cpu":
            for kv_cache in self.tensors:
                kv_cache.zero_()

    def copy_blocks(self, block_copies: list[BlockCopy]) -> None:
        """Copy the heads of cached blocks into the blocks that reuse them (prefix hits that end inside a
        block, n > 1 completions forking their prompt): plain rows of the cache tensor, the same on every
        attention backend, done before any pass of the step writes or reads the cache."""
        for kv_cache in self.tensors:
            # [2 (or 1), layers, blocks, block_size, kv_heads, head_dim]
            for copy in block_copies:
                kv_cache[:, :, copy.dst, :copy.num_tokens] = kv_cache[:, :, copy.src, :copy.num_tokens]


def num_kvcache_blocks(config: EngineConfig, device: torch.device, block_bytes: int, activation_peak_bytes: int,
                       max_num_blocks_per_seq: int, all_ranks_min: Callable[[int], int]) -> int:
    """The blocks every rank holds: the fewest any rank can (all_ranks_min: over every rank of the engine)."""
    num_blocks, problem = _blocks_that_fit(config, device, block_bytes, activation_peak_bytes,
                                           max_num_blocks_per_seq)
    # every rank must agree on the ledger's size, and on failing: take the smallest (0 where one fails)
    agreed = all_ranks_min(0 if problem else num_blocks)
    if problem:
        raise ValueError(problem)
    if agreed < 1:
        raise ValueError(f"no room for a single KV-cache block of {block_bytes} bytes on every rank; "
                         f"lower kvcache_block_size or free memory")
    return agreed


def _blocks_that_fit(config: EngineConfig, device: torch.device, block_bytes: int, activation_peak_bytes: int,
                     max_num_blocks_per_seq: int) -> tuple[int, str | None]:
    """The blocks this rank can hold, and why not when a setting asks for more than there is."""
    if device.type == "cuda":
        # total * utilization, less what is in use now (weights, CUDA context, other processes) and
        # the activation peak the warm-up measured
        free, total = torch.cuda.mem_get_info(device)
        available = free - (1.0 - config.gpu_memory_utilization) * total - activation_peak_bytes
        where = f"GPU {device.index} at gpu_memory_utilization={config.gpu_memory_utilization}"
    else:
        ranks_on_host = config.world_size  # CPU ranks of one engine share the host's memory
        available = available_host_memory() / ranks_on_host
        where = f"this host per rank ({ranks_on_host} rank(s))"
    if config.num_kvcache_blocks is not None:
        need = config.num_kvcache_blocks * block_bytes
        if need > available:
            return 0, (f"num_kvcache_blocks={config.num_kvcache_blocks} needs a KV cache of {_gib(need)} per "
                       f"rank, but {_gib(max(available, 0))} is available on {where}")
        return config.num_kvcache_blocks, None
    if config.kvcache_memory_gb is not None:
        budget = config.kvcache_memory_gb * (1 << 30)
        if budget > available:
            return 0, (f"kvcache_memory_gb={config.kvcache_memory_gb} asks for a KV cache of {_gib(budget)} per "
                       f"rank, but {_gib(max(available, 0))} is available on {where}")
    elif device.type == "cuda":
        budget = available
    else:
        budget = min(DEFAULT_CPU_KVCACHE_GB * (1 << 30), available)
    useful = config.max_num_seqs * max_num_blocks_per_seq  # never more than the limits can use
    return max(0, min(useful, int(budget) // block_bytes)), None
