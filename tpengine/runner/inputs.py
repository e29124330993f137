"""A step message into a forward's inputs, on every rank: the running sequences' block tables, kept from
step to step as the messages change them, and the step's rows (decode tokens first, then prompt chunks)
as tensors and one attention-metadata value."""
from dataclasses import dataclass

import torch

from tpengine.attention.metadata import AttentionMetadata
from tpengine.distributed.messages import StepMessage
from tpengine.paging import blocks_for
from tpengine.platforms import platform_for
from tpengine.runner.block_tables import BlockTables


@dataclass
class ForwardInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor | None    # the rows whose logits are wanted; None: the first num_logits rows
    num_logits: int                     # rows sampled: every decode row, each sampled chunk's last row, then
                                        # every row of each verify row


class InputBuilder:
    """Step messages into forward inputs. Padding rows follow the decode rows (a decode row with nothing to
    attend to and no cache slot) up to the platform's row bucket (on the CPU: platforms/cpu.py), and the LM
    head's rows are padded the same way; only the first num_logits rows of its logits are real."""

    def __init__(self, block_size: int, device: torch.device, long_rope_threshold: int | None = None,
                 max_positions: int = 0):
        """long_rope_threshold: LongRoPE's window (None: another rope); a row rotated with its long factors takes
        its position plus max_positions, where the rotary cache holds the long set (layers/rotary_embedding.py)."""
        self.block_size = block_size
        self.long_rope_threshold = long_rope_threshold
        self.max_positions = max_positions
        self.device = device
        self.row_bucket = platform_for(device).row_bucket
        self.block_tables = BlockTables()

    def _tensor(self, data, dtype=torch.int64) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, pin_memory=self.device.type == "cuda").to(self.device, non_blocking=True)

    def _block_tables(self, tables: list[list[int]]) -> torch.Tensor:
        width = max(len(t) for t in tables)
        return self._tensor([t + [0] * (width - len(t)) for t in tables], torch.int32)

    def prepare(self, step: StepMessage) -> ForwardInputs:
        """Update the block tables with the step's changes, then build its inputs."""
        self.block_tables.update(step)
        return self.build(step)

    def build(self, step: StepMessage) -> ForwardInputs:
        """The inputs of a step whose block-table changes are applied already (prepare, or a draft model's
        decode rows within a step: runner/drafter.py)."""
        tables = self.block_tables.tables
        block_size = self.block_size
        num_rows = step.num_rows
        num_padding = self.row_bucket(num_rows) - num_rows
        decode_tables = [tables[seq_id] for seq_id in step.decode_seq_ids]
        context_lens = step.decode_context_lens
        input_ids = step.decode_tokens
        chunks = step.prefill
        num_verify_rows = 0
        if any(chunk.num_draft_tokens for chunk in chunks):
            # A verify row runs as decode queries, one per token, each over its context so far (the K/V of
            # the tokens before it is stored first, as a decode row's own): the decode kernel serves them,
            # and a step of decode and verify rows alone stays a decode step.
            verify = [chunk for chunk in chunks if chunk.num_draft_tokens]
            chunks = [chunk for chunk in chunks if not chunk.num_draft_tokens]
            context_lens, input_ids = list(context_lens), list(input_ids)
            for chunk in verify:
                table = tables[chunk.seq_id]
                num_verify_rows += len(chunk.token_ids)
                input_ids += chunk.token_ids
                start = chunk.num_cached_tokens
                context_lens += range(start + 1, start + len(chunk.token_ids) + 1)
                decode_tables += [table] * len(chunk.token_ids)
        input_ids = input_ids + [0] * num_padding
        positions = [n - 1 for n in context_lens]
        threshold = self.long_rope_threshold
        if threshold is not None:
            # the ledger keeps a short sequence's decode and verify rows within the window (engine/scheduler.py),
            # and a long one's past it: a row's set follows from its context
            positions = [p + self.max_positions if p >= threshold else p for p in positions]
        positions += [0] * num_padding
        slot_mapping = [table[(n - 1) // block_size] * block_size + (n - 1) % block_size
                        for table, n in zip(decode_tables, context_lens)] + [-1] * num_padding
        if num_padding:
            context_lens = context_lens + [0] * num_padding
            decode_tables += [[0]] * num_padding
        decode = self._decode_metadata(slot_mapping, context_lens, decode_tables) if context_lens else None
        num_decode = len(input_ids)  # padding rows included
        if not chunks:  # sampled in row order: the decode rows, then the verify rows
            return ForwardInputs(self._tensor(input_ids), self._tensor(positions), decode, None,
                                 len(step.decode_seq_ids) + num_verify_rows)
        seqlens_q, seqlens_k, prefill_tables = [], [], []
        for chunk in chunks:
            table = tables[chunk.seq_id]
            prefill_tables.append(table)
            start, end = chunk.num_cached_tokens, chunk.num_cached_tokens + len(chunk.token_ids)
            input_ids.extend(chunk.token_ids)
            offset = self.max_positions if chunk.long_rope else 0
            positions.extend(range(start + offset, end + offset))
            seqlens_q.append(end - start)
            seqlens_k.append(end)
            for i in range(start // block_size, blocks_for(end, block_size)):
                base = table[i] * block_size
                slot_mapping.extend(range(base + max(start - i * block_size, 0),
                                          base + min(end - i * block_size, block_size)))
        cu_q = [0]
        cu_k = [0]
        for len_q, len_k in zip(seqlens_q, seqlens_k):
            cu_q.append(cu_q[-1] + len_q)
            cu_k.append(cu_k[-1] + len_k)
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=self._tensor(slot_mapping),  # every row's, the decode rows' too: one store
            block_tables=self._block_tables(prefill_tables),
            has_cached_prefix=any(chunk.num_cached_tokens for chunk in chunks),
            cu_seqlens_q=self._tensor(cu_q, torch.int32), cu_seqlens_k=self._tensor(cu_k, torch.int32),
            seqlens_q=seqlens_q, seqlens_k=seqlens_k, max_seqlen_q=max(seqlens_q), max_seqlen_k=max(seqlens_k),
            num_decode_tokens=num_decode, decode=decode)
        num_decode_rows = len(step.decode_seq_ids)
        logits_rows = list(range(num_decode_rows))
        logits_rows += [num_decode + end - 1 for chunk, end in zip(chunks, cu_q[1:]) if chunk.sampled]
        logits_rows += range(num_decode_rows, num_decode_rows + num_verify_rows)  # sampled after the prompts
        num_logits = len(logits_rows)
        if logits_rows:
            logits_rows += logits_rows[-1:] * (self.row_bucket(num_logits) - num_logits)
        return ForwardInputs(self._tensor(input_ids), self._tensor(positions), meta, self._tensor(logits_rows),
                             num_logits)

    def _decode_metadata(self, slot_mapping: list[int], context_lens: list[int],
                         block_tables: list[list[int]]) -> AttentionMetadata:
        """The decode rows' metadata: one query per sequence over its context (0 for a padding row)."""
        return AttentionMetadata(
            is_prefill=False, slot_mapping=self._tensor(slot_mapping[:len(context_lens)]),
            block_tables=self._block_tables(block_tables), block_tables_list=block_tables, seqlens_k=context_lens,
            context_lens=self._tensor(context_lens, torch.int32), max_seqlen_k=max(context_lens))
