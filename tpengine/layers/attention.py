"""Attention over this rank's shard of the paged KV cache, through the chosen backend."""
import torch
from torch import nn

from tpengine.attention.backend import AttentionBackend, AttentionParams
from tpengine.attention.metadata import AttentionMetadata
from tpengine.distributed.parallel_state import get_tp_group
from tpengine.layers.linear import check_weight_shape


class Attention(nn.Module):
    """sliding_window, logit_softcap and sinks: see AttentionParams. sinks, when the layer has them, is a
    parameter of this rank's num_heads heads, loaded from the checkpoint's slice."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 backend: AttentionBackend, *, sliding_window: int | None = None,
                 logit_softcap: float | None = None, has_sinks: bool = False):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend = backend
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.sinks = None
        if has_sinks:  # float32 whatever the model's dtype: one logit per head, added inside the softmax
            self.sinks = nn.Parameter(torch.empty(num_heads, dtype=torch.float32), requires_grad=False)
            self.sinks.weight_loader = self._load_sinks
        self.params = AttentionParams(scale, sliding_window, logit_softcap, self.sinks)
        backend.check(self.params)
        # Bound to views of the runner's cache tensor once it is allocated.
        self.k_cache = self.v_cache = torch.tensor([])

    def _load_sinks(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """This rank's heads of the checkpoint's [num_attention_heads] sinks."""
        check_weight_shape(loaded_weight, (self.num_heads * self.tp_size,))
        param.data.copy_(loaded_weight.narrow(0, self.tp_rank * self.num_heads, self.num_heads))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim]
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.params)
