"""The C++ paged decode attention for the CPU (paged_decode_attention.cpp), built on first use by
kernels/cpu/build.py and loaded as the torch op `torch.ops.tpengine_cpu.paged_decode_attention`."""
import functools

import torch

from tpengine.kernels.cpu.build import build_and_load


@functools.cache
def load() -> None:
    """Build the op if this machine has no build of it yet, then load it; RuntimeError saying why not."""
    build_and_load("paged_decode_attention.cpp")


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None, *,
                           window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None,
                           max_splits: int = 0) -> torch.Tensor:
    """out[b] = softmax(scale * q[b] K_b^T) V_b over the first context_lens[b] cached tokens of sequence b.

    q: [batch, num_heads, head_dim] (head_dim contiguous); caches: [num_blocks, block_size, num_kv_heads,
    head_dim] (v_cache's head_dim may be fewer, a view of a latent cache's first columns: out then has that width); block_tables: [batch, max_num_blocks] int32; context_lens: [batch] int32, where 0 marks a
    padding row (its output is 0). window > 0: only the last `window` tokens are attended (and read);
    softcap > 0: scores become softcap * tanh(scores / softcap); sinks: [num_heads] float32 logits, one more
    softmax term each, with no value. The same contract as the Triton kernel of the same name. max_splits: the most
    runs one sequence's keys are split into across threads when the batch is smaller than the threads (0: as many as
    help; 1: none, so a row's result is the same bits in any batch).
    """
    load()
    if out is None:
        out = torch.empty((*q.shape[:2], v_cache.size(-1)), dtype=q.dtype, device=q.device)  # a replayable op
    torch.ops.tpengine_cpu.paged_decode_attention(out, q, k_cache, v_cache, block_tables, context_lens, scale,
                                                  window, softcap, sinks, max_splits)
    return out
