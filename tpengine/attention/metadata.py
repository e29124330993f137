"""The one per-step value that tells every attention layer where K/V live and what to attend to."""
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    is_prefill: bool
    slot_mapping: torch.Tensor             # [num_tokens] cache slot of each new token; -1 = padding
    block_tables: torch.Tensor             # [batch, max_num_blocks] int32, padded with 0
    # the same per-sequence numbers as Python lists, for backends that loop over sequences on the host;
    # seqlens_k[b] is sequence b's number of keys (its context length in decode)
    block_tables_list: list[list[int]] | None = None
    seqlens_k: list[int] | None = None
    # prefill (varlen): sequence b's new tokens are the last seqlens_q[b] of its seqlens_k
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    seqlens_q: list[int] | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    has_cached_prefix: bool = False        # some sequence attends to K/V computed in an earlier step
    # [prefill rows] int32: the end (exclusive) of the positions each prefill row sees, past its own where an
    # image's tokens attend to each other both ways (Gemma 3); None: causal, each row sees up to itself
    key_ends: torch.Tensor | None = None
    # decode: one query per sequence over context_lens[b] cached tokens
    context_lens: torch.Tensor | None = None
    # a mixed step (is_prefill, with decode tokens too): its first num_decode_tokens rows are decode
    # tokens, attended through `decode` (their own decode metadata); the varlen fields above, the block
    # tables included, describe only the prefill rows after them; slot_mapping covers every row
    num_decode_tokens: int = 0
    decode: "AttentionMetadata | None" = None
    # what a backend works out from the fields above once a step: made by the step's first attention layer, read by
    # the rest (the CPU backend's rows of short chunks over a cached prefix)
    backend_plan: object = None
