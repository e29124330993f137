"""Attention over this rank's shard of the paged KV cache, through the chosen backend."""
import torch
from torch import nn

from tpengine.attention.backend import AttentionBackend, AttentionParams
from tpengine.attention.metadata import AttentionMetadata
from tpengine.distributed.parallel_state import get_tp_group
from tpengine.layers.load_state import attach, check_weight_shape


# a checkpoint's KV-cache scales (compressed-tensors, ModelOpt, vLLM's FP8 exports) -> this layer's parameter,
# under the decoder layer's self_attn.; the name's attention module is `attn` here
KV_SCALE_NAMES = {".k_proj.output_scale": ".attn.k_scale", ".v_proj.output_scale": ".attn.v_scale",
                  ".k_proj.k_scale": ".attn.k_scale", ".v_proj.v_scale": ".attn.v_scale",
                  ".self_attn.k_scale": ".self_attn.attn.k_scale", ".self_attn.v_scale": ".self_attn.attn.v_scale"}


def kv_scale_target(name: str) -> str | None:
    """Our parameter for a checkpoint's KV-cache scale, or None when name is not one."""
    for suffix, ours in KV_SCALE_NAMES.items():
        if name.endswith(suffix):
            return name.removesuffix(suffix) + ours
    return None


class Attention(nn.Module):
    """sliding_window, logit_softcap and sinks: see AttentionParams. sinks, when the layer has them, is a
    parameter of this rank's num_heads heads, loaded from the checkpoint's slice. k_scale and v_scale, an FP8
    KV cache's per-tensor scales, are 1.0 (vLLM's default) unless the checkpoint has them."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 backend: AttentionBackend, *, sliding_window: int | None = None,
                 logit_softcap: float | None = None, has_sinks: bool = False, values_are_keys: bool = False):
        super().__init__()
        # the values are the keys themselves (a latent cache): one cache tensor serves both
        self.values_are_keys = values_are_keys
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
            attach(self.sinks, self._load_sinks)
        self.k_scale, self.v_scale = self._kv_scale(), self._kv_scale()
        self.params = AttentionParams(scale, sliding_window, logit_softcap, self.sinks, self.k_scale, self.v_scale)
        backend.check(self.params)
        # Bound to views of the runner's cache tensor once it is allocated.
        self.k_cache = self.v_cache = torch.tensor([])

    def _kv_scale(self) -> nn.Parameter:
        scale = nn.Parameter(torch.ones(1, dtype=torch.float32), requires_grad=False)
        attach(scale, self._load_kv_scale, shards=[])  # optional: a checkpoint without it leaves 1.0
        return scale

    @staticmethod
    def _load_kv_scale(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """One scale for the whole layer, the same on every rank (stored as [] or [1])."""
        if loaded_weight.numel() != 1:
            raise ValueError(f"a KV-cache scale must be one number per layer (per-tensor), got shape "
                             f"{tuple(loaded_weight.shape)}")
        value = loaded_weight.float().reshape(1)
        if not (value > 0).all() or not value.isfinite().all():
            raise ValueError(f"a KV-cache scale must be finite and > 0, got {value.item()}")
        param.data.copy_(value)

    def _load_sinks(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """This rank's heads of the checkpoint's [num_attention_heads] sinks."""
        check_weight_shape(loaded_weight, (self.num_heads * self.tp_size,))
        param.data.copy_(loaded_weight.narrow(0, self.tp_rank * self.num_heads, self.num_heads))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim]
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.params)
