"""Decode steps replayed from CUDA graphs: one graph per batch-size bucket, all over the same static buffers.

A decode step launches a few hundred small kernels; replaying them as one graph removes the
launch overhead that dominates small batches. Prefill, and decode batches past the largest
bucket, run eagerly. Never used on CPU.
"""
import torch
from torch import nn

from tpengine.attention.metadata import AttentionMetadata

MAX_GRAPH_BATCH_SIZE = 512


def graph_batch_sizes(max_num_seqs: int, num_speculative_tokens: int = 0) -> list[int]:
    """1, 2, 4, 8, then steps of 16, up to the first bucket that holds min(max rows, 512) rows: max_num_seqs
    decode rows, or with speculation as many verify rows of 1 + k decode queries each."""
    limit = min(max_num_seqs * (1 + num_speculative_tokens), MAX_GRAPH_BATCH_SIZE)
    sizes = []
    for size in [1, 2, 4, 8, *range(16, MAX_GRAPH_BATCH_SIZE + 1, 16)]:
        sizes.append(size)
        if size >= limit:
            break
    return sizes


class DecodeCudaGraphs:
    """Captured decode forwards of `model`, one per bucket; run() pads a batch up to its bucket and replays."""

    def __init__(self, model: nn.Module, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 max_num_seqs: int, max_num_blocks_per_seq: int, block_size: int, num_speculative_tokens: int = 0):
        self.model = model
        self.batch_sizes = graph_batch_sizes(max_num_seqs, num_speculative_tokens)
        self.max_num_blocks_per_seq = max_num_blocks_per_seq
        max_bs = self.batch_sizes[-1]
        with torch.device(device):
            # Graphs read and write these addresses on every replay; run() only ever copies into them.
            self.input_ids = torch.zeros(max_bs, dtype=torch.int64)
            self.positions = torch.zeros(max_bs, dtype=torch.int64)
            self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.int64)  # -1: nothing is stored
            self.context_lens = torch.zeros(max_bs, dtype=torch.int32)        # 0: nothing is read
            self.block_tables = torch.zeros(max_bs, max_num_blocks_per_seq, dtype=torch.int32)
            # outside the graphs' pool: no replay of another bucket can overwrite it
            self.hidden_states = torch.empty(max_bs, hidden_size, dtype=dtype)
        self.max_seqlen_k = max_num_blocks_per_seq * block_size
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture_all()

    def _metadata(self, batch_size: int) -> AttentionMetadata:
        """Decode metadata over the first batch_size rows of the static buffers."""
        return AttentionMetadata(
            is_prefill=False, slot_mapping=self.slot_mapping[:batch_size],
            block_tables=self.block_tables[:batch_size], context_lens=self.context_lens[:batch_size],
            max_seqlen_k=self.max_seqlen_k)

    def _forward(self, batch_size: int, meta: AttentionMetadata) -> None:
        self.hidden_states[:batch_size] = self.model(self.input_ids[:batch_size], self.positions[:batch_size], meta)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        # One private pool for every bucket. Largest first, so the smaller captures fit in the blocks it
        # reserved. Sharing is safe in any replay order: each graph's tensors die before its capture ends
        # (its result is copied out to hidden_states), and replays never overlap (one stream).
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        for batch_size in reversed(self.batch_sizes):
            meta = self._metadata(batch_size)
            # Warm-up on a side stream, as torch's docs do before capture: the Triton/compiled kernels are
            # built and the lazy library state is set up outside the graph.
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._forward(batch_size, meta)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # Every rank captures the same buckets in the same order: the all-reduces inside line up.
            with torch.cuda.graph(graph, pool=pool):
                self._forward(batch_size, meta)
            self.graphs[batch_size] = graph
        torch.cuda.synchronize()

    def can_run(self, batch_size: int, block_table_width: int) -> bool:
        return batch_size <= self.batch_sizes[-1] and block_table_width <= self.max_num_blocks_per_seq

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The decode forward's hidden states [batch, hidden], a view of the static output: read it before
        the next run()."""
        n = input_ids.size(0)
        bucket = next(size for size in self.batch_sizes if size >= n)
        width = meta.block_tables.size(1)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.context_lens[:n].copy_(meta.context_lens)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        # padding rows: store nothing, attend to nothing, point at block 0
        self.input_ids[n:bucket].zero_()
        self.positions[n:bucket].zero_()
        self.slot_mapping[n:bucket].fill_(-1)
        self.context_lens[n:bucket].zero_()
        self.block_tables[n:bucket].zero_()
        self.graphs[bucket].replay()
        return self.hidden_states[:n]
