"""Vocabulary-parallel embedding and LM head; the vocabulary is padded to a multiple of tp."""
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from tpengine.distributed.parallel_state import get_tp_group
from tpengine.layers.batch_invariant import model_linear
from tpengine.layers.load_state import (Loaded, attach, check_weight_shape, keep_quantized, load_state,
                                        packed_as_loaded)
from tpengine.platforms import current_platform
from tpengine.quantization.weights import QuantizedWeight, cat_rows


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_group = get_tp_group()
        self.tp_rank = self.tp_group.rank
        self.tp_size = self.tp_group.size
        self.num_embeddings = num_embeddings
        padded = -(-num_embeddings // self.tp_size) * self.tp_size
        self.num_embeddings_per_partition = padded // self.tp_size
        self.vocab_start_idx = self.num_embeddings_per_partition * self.tp_rank
        self.vocab_end_idx = self.vocab_start_idx + self.num_embeddings_per_partition
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim),
                                   requires_grad=False)
        attach(self.weight, self.weight_loader, takes=(QuantizedWeight,))  # quantized: rows dequantized as gathered
        self.dtype = self.weight.dtype  # the model's: the rows' dtype, whatever the table is kept in
        platform = current_platform()
        self.pack_quantized_weight, self.embedding_rows = platform.pack_quantized_weight, platform.embedding_rows
        self.pack_linear_weight = platform.pack_linear_weight
        self.packed_rows = None

    def weight_loader(self, param: nn.Parameter, loaded_weight: Loaded) -> None:
        check_weight_shape(loaded_weight, [self.num_embeddings, *param.shape[1:]])
        # The last shard may run past the real vocabulary: its padding rows stay zero.
        start = min(self.vocab_start_idx, self.num_embeddings)
        real = min(self.vocab_end_idx, self.num_embeddings) - start
        if isinstance(loaded_weight, QuantizedWeight):
            shard = loaded_weight.rows(start, real)
            padding = self.num_embeddings_per_partition - real
            if padding:
                zero = lambda t: None if t is None else t.new_zeros(padding, t.size(1))  # noqa: E731
                shard = cat_rows([shard, replace(shard, qweight=zero(shard.qweight), scales=zero(shard.scales),
                                                 zeros=zero(shard.zeros), minimums=zero(shard.minimums))])
            keep_quantized(param, shard)
            return
        param.data.zero_()
        param.data[:real].copy_(loaded_weight[start:start + real])

    def gathered_rows(self, token_ids: list[int]) -> torch.Tensor:
        """float32 rows of the whole table for token_ids on every rank (an all-reduce: every rank calls it), read
        after loading and before prepack, from the float shard or a quantized one's dequantized rows."""
        rows = torch.zeros(len(token_ids), self.weight.size(1), dtype=torch.float32, device=self.weight.device)
        quantized = load_state(self.weight).quantized_parts.get(())
        for i, token_id in enumerate(token_ids):
            local = token_id - self.vocab_start_idx
            if 0 <= local < self.vocab_end_idx - self.vocab_start_idx:
                rows[i] = self.weight[local].float() if quantized is None else quantized.rows(local, 1).dequantize()[0]
        if self.tp_size > 1:
            self.tp_group.all_reduce(rows)
        return rows

    def prepack(self, weight_dtype: torch.dtype | None = None) -> None:
        """After loading: a quantized table stays packed; its rows are dequantized as tokens gather them. So does a
        table kept in weight_dtype (the platform's linear_weight_dtype), in the LM head's packed form: a tied
        head shares it."""
        self.packed_rows = packed_as_loaded(self.weight, weight_dtype, self.pack_quantized_weight,
                                            self.pack_linear_weight)

    def lookup(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.packed_rows is None:
            return F.embedding(token_ids, self.weight)
        return self.embedding_rows(token_ids, self.packed_rows, self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.lookup(x)
        in_shard = (x >= self.vocab_start_idx) & (x < self.vocab_end_idx)
        y = self.lookup((x - self.vocab_start_idx) * in_shard)
        y = y * in_shard.unsqueeze(1)
        self.tp_group.all_reduce(y)
        return y


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for the real vocabulary, gathered on rank 0 (other ranks get None); or, gather=False, every
    rank's own slice of them, columns vocab_start_idx onwards."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__(num_embeddings, embedding_dim)
        self.linear = model_linear(current_platform().linear)
        self.packed_weight = None

    def prepack(self, weight_dtype: torch.dtype | None = None) -> None:
        """After loading: logits from the platform's packed copy where it makes one (the CPU's, or a quantized
        weight's). A float weight stays: a tied embedding shares it; one kept in weight_dtype is shared packed."""
        self.packed_weight = packed_as_loaded(self.weight, weight_dtype, self.pack_quantized_weight,
                                              self.pack_linear_weight)
        if self.packed_weight is None:
            self.packed_weight = self.pack_linear_weight(self.weight)

    def forward(self, x: torch.Tensor, gather: bool = True, num_rows: int | None = None) -> torch.Tensor | None:
        """num_rows: only the first rows are wanted (the rest pad the matmul to a size it has a kernel for)."""
        logits = self.linear(x, self.weight, None, self.packed_weight)
        if num_rows is not None:
            logits = logits[:num_rows]
        if not gather:  # the last shard's padding columns are never sampled
            return logits[..., :max(0, self.num_embeddings - self.vocab_start_idx)]
        if self.tp_size > 1:
            logits = self.tp_group.gather_to_first(logits)
            if logits is None:
                return None
        return logits[..., :self.num_embeddings]  # padding columns are never sampled
