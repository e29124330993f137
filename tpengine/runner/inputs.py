"""A step message into a forward's inputs, on every rank: the running sequences' block tables, kept from
step to step as the messages change them, and the step's rows (decode tokens first, then prompt chunks)
as tensors and one attention-metadata value."""
from dataclasses import dataclass

import numpy as np
import torch

from tpengine.attention.metadata import AttentionMetadata
from tpengine.distributed.messages import ImageChunk, PrefillChunk, StepMessage
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
    lora_slots: np.ndarray | None = None  # each row's LoRA adapter slot (-1: none), when the engine serves adapters
    # an image model's prompt rows that read an image's embeddings instead of their tokens': (sequence, image,
    # first row in the forward, first of the image's tokens, how many)
    image_rows: list[tuple[int, ImageChunk, int, int, int]] | None = None


class InputBuilder:
    """Step messages into forward inputs. Padding rows follow the decode rows (a decode row with nothing to
    attend to and no cache slot) up to the platform's row bucket (on the CPU: platforms/cpu.py), and the LM
    head's rows are padded the same way; only the first num_logits rows of its logits are real."""

    def __init__(self, block_size: int, device: torch.device, long_rope_threshold: int | None = None,
                 max_positions: int = 0, lora: bool = False, mrope: bool = False, images: bool = False,
                 bidirectional_images: bool = False):
        """long_rope_threshold: LongRoPE's window (None: another rope); a row rotated with its long factors takes
        its position plus max_positions, where the rotary cache holds the long set (layers/rotary_embedding.py).
        mrope: the model rotates by M-RoPE (layers/mrope.py): a step with prompt rows has positions [3, rows].
        images: the model reads images (their rows listed); bidirectional_images: an image's rows see to its end."""
        self.mrope, self.images, self.bidirectional_images = mrope, images, bidirectional_images
        self.block_size = block_size
        self.long_rope_threshold = long_rope_threshold
        self.max_positions = max_positions
        self.device = device
        self.row_bucket = platform_for(device).row_bucket
        self.block_tables = BlockTables()
        self.lora = lora  # each row's adapter slot goes with the inputs

    def _tensor(self, data, dtype=np.int64) -> torch.Tensor:
        """A list or numpy array on the device (through pinned memory on CUDA)."""
        tensor = torch.from_numpy(np.asarray(data, dtype=dtype))
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor

    def prepare(self, step: StepMessage) -> ForwardInputs:
        """Update the block tables with the step's changes, then build its inputs."""
        self.block_tables.update(step)
        return self.build(step)

    def build(self, step: StepMessage) -> ForwardInputs:
        """The inputs of a step whose block-table changes are applied already (prepare, or a draft model's
        decode rows within a step: runner/drafter.py). Decode rows are built as whole columns (numpy), from
        the message's packed columns and the tables' rows; prompt chunks token by token."""
        num_padding = self.row_bucket(step.num_rows) - step.num_rows
        seq_ids, input_ids, context_lens, chunks, num_verify_rows = decode_columns(step)
        positions, slot_mapping, decode = self._decode_rows(seq_ids, context_lens, num_padding)
        if step.decode_position_offsets:  # M-RoPE: a generated token's position is its index plus its prompt's delta
            positions[:step.num_decode_rows] += np.frombuffer(step.decode_position_offsets, dtype=np.int64)
        input_ids = np.concatenate([input_ids, np.zeros(num_padding, dtype=np.int64)])
        num_decode_rows = len(seq_ids) - num_verify_rows
        if not chunks:  # sampled in row order: the decode rows, then the verify rows
            inputs = ForwardInputs(self._tensor(input_ids), self._tensor(positions), decode, None,
                                   num_decode_rows + num_verify_rows)
        else:
            inputs = self._prefill_inputs(chunks, input_ids, positions, slot_mapping, decode, num_decode_rows,
                                          num_verify_rows)
        if self.lora:
            verify = [chunk for chunk in step.prefill if chunk.num_draft_tokens] if num_verify_rows else []
            inputs.lora_slots = row_slots(step, verify, chunks, num_padding)
        return inputs

    def _decode_rows(self, seq_ids: np.ndarray, context_lens: np.ndarray,
                     num_padding: int) -> tuple[np.ndarray, np.ndarray, AttentionMetadata | None]:
        """The decode (and verify) rows' positions and cache slots, then num_padding padding rows', and their
        decode metadata (None: no rows)."""
        block_tables, block_size = self.block_tables, self.block_size
        # padding rows: token 0 at position 0, nothing to attend to, no cache slot, row 0's (empty) table
        rows = np.concatenate([block_tables.row_indices(seq_ids.tolist()), np.zeros(num_padding, dtype=np.int64)])
        num_decode = len(rows)  # padding rows included
        positions = np.zeros(num_decode, dtype=np.int64)
        slot_mapping = np.full(num_decode, -1, dtype=np.int64)
        if not num_decode:
            return positions, slot_mapping, None
        table = block_tables.padded(rows)
        real = len(seq_ids)
        last = context_lens - 1  # each row's own position
        block_ids = table[np.arange(real), last // block_size].astype(np.int64)
        slot_mapping[:real] = block_ids * block_size + last % block_size
        threshold = self.long_rope_threshold
        if threshold is not None:
            # the ledger keeps a short sequence's decode and verify rows within the window (engine/scheduler.py),
            # and a long one's past it: a row's set follows from its context
            last = np.where(last >= threshold, last + self.max_positions, last)
        positions[:real] = last
        lens = np.zeros(num_decode, dtype=np.int32)
        lens[:real] = context_lens
        decode = AttentionMetadata(
            is_prefill=False, slot_mapping=self._tensor(slot_mapping), block_tables=self._tensor(table, np.int32),
            context_lens=self._tensor(lens, np.int32), max_seqlen_k=int(lens.max()))
        return positions, slot_mapping, decode

    def _prefill_inputs(self, chunks: list[PrefillChunk], input_ids: np.ndarray, positions: np.ndarray,
                        slot_mapping: np.ndarray, decode: AttentionMetadata | None, num_decode_rows: int,
                        num_verify_rows: int) -> ForwardInputs:
        """A step with prompt chunks: their rows after the decode (verify, padding) rows, one prefill metadata over
        every row, and the rows sampled: the decode rows, each sampled chunk's last row, then the verify rows."""
        num_decode = len(positions)  # padding rows included
        input_ids, positions, slot_mapping = input_ids.tolist(), positions.tolist(), slot_mapping.tolist()
        seqlens_q, seqlens_k = self._add_chunk_rows(chunks, input_ids, positions, slot_mapping)
        cu_q = [0]
        cu_k = [0]
        for len_q, len_k in zip(seqlens_q, seqlens_k):
            cu_q.append(cu_q[-1] + len_q)
            cu_k.append(cu_k[-1] + len_k)
        block_tables = self.block_tables
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=self._tensor(slot_mapping),  # every row's, the decode rows' too: one store
            block_tables=self._tensor(block_tables.padded(block_tables.row_indices(chunk.seq_id for chunk in chunks)),
                                      np.int32),
            has_cached_prefix=any(chunk.num_cached_tokens for chunk in chunks),
            cu_seqlens_q=self._tensor(cu_q, np.int32), cu_seqlens_k=self._tensor(cu_k, np.int32),
            seqlens_q=seqlens_q, seqlens_k=seqlens_k, max_seqlen_q=max(seqlens_q), max_seqlen_k=max(seqlens_k),
            num_decode_tokens=num_decode, decode=decode)
        logits_rows = list(range(num_decode_rows))
        logits_rows += [num_decode + end - 1 for chunk, end in zip(chunks, cu_q[1:]) if chunk.sampled]
        logits_rows += range(num_decode_rows, num_decode_rows + num_verify_rows)  # sampled after the prompts
        num_logits = len(logits_rows)
        if logits_rows:
            logits_rows += logits_rows[-1:] * (self.row_bucket(num_logits) - num_logits)
        if self.mrope:
            positions = chunk_mrope_positions(chunks, positions, num_decode, cu_q)
        image_rows = chunk_image_rows(chunks, num_decode, cu_q) if self.images else None
        if self.bidirectional_images and image_rows:
            meta.key_ends = self._tensor(chunk_key_ends(chunks, cu_q), np.int32)
        return ForwardInputs(self._tensor(input_ids), self._tensor(positions), meta, self._tensor(logits_rows),
                             num_logits, image_rows=image_rows)

    def _add_chunk_rows(self, chunks: list[PrefillChunk], input_ids: list[int], positions: list[int],
                        slot_mapping: list[int]) -> tuple[list[int], list[int]]:
        """Append each chunk's tokens, positions and cache slots to the lists; its query and key lengths."""
        tables, block_size = self.block_tables.tables, self.block_size
        seqlens_q, seqlens_k = [], []
        for chunk in chunks:
            table = tables[chunk.seq_id]
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
        return seqlens_q, seqlens_k


def chunk_mrope_positions(chunks: list[PrefillChunk], positions: list[int], num_decode: int,
                          cu_q: list[int]) -> np.ndarray:
    """Every row's M-RoPE positions [3, rows]: a row's index on all three (decode and text rows), an image prompt's
    chunk rows as its message gives them."""
    table = np.tile(np.asarray(positions, dtype=np.int64), (3, 1))
    for chunk, start, end in zip(chunks, cu_q, cu_q[1:]):
        if chunk.positions:
            table[:, num_decode + start:num_decode + end] = np.frombuffer(chunk.positions, np.int64).reshape(3, -1)
    return table


def chunk_image_rows(chunks: list[PrefillChunk], num_decode: int,
                     cu_q: list[int]) -> list[tuple[int, ImageChunk, int, int, int]]:
    """The rows of the step that read image embeddings: for each image a chunk overlaps, (sequence, image, the
    first such row in the forward, its index among the image's tokens, how many rows)."""
    rows = []
    for chunk, row in zip(chunks, cu_q):
        start, end = chunk.num_cached_tokens, chunk.num_cached_tokens + len(chunk.token_ids)
        for image in chunk.images:
            lo, hi = max(start, image.offset), min(end, image.offset + image.num_tokens)
            rows.append((chunk.seq_id, image, num_decode + row + lo - start, lo - image.offset, hi - lo))
    return rows


def chunk_key_ends(chunks: list[PrefillChunk], cu_q: list[int]) -> np.ndarray:
    """Each prompt row's key end: its position + 1, or its image's end for an image's rows (a step holds an image's
    rows together: the scheduler never ends a chunk inside one)."""
    key_ends = np.empty(cu_q[-1], dtype=np.int64)
    for chunk, row in zip(chunks, cu_q):
        start, end = chunk.num_cached_tokens, chunk.num_cached_tokens + len(chunk.token_ids)
        key_ends[row:row + end - start] = np.arange(start + 1, end + 1)
        for image in chunk.images:
            image_end = image.offset + image.num_tokens
            assert image_end <= end, "a chunk never ends inside an image whose tokens attend both ways"
            lo = max(start, image.offset)
            key_ends[row + lo - start:row + image_end - start] = image_end
    return key_ends


def decode_columns(step: StepMessage) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[PrefillChunk], int]:
    """The decode rows' sequence ids, tokens and context lengths, each verify row's appended as decode queries; the
    prompt chunks that are left; and how many verify rows there are."""
    seq_ids = np.frombuffer(step.decode_seq_ids, dtype=np.int64)
    input_ids = np.frombuffer(step.decode_tokens, dtype=np.int64)
    context_lens = np.frombuffer(step.decode_context_lens, dtype=np.int64)
    chunks = step.prefill
    if not any(chunk.num_draft_tokens for chunk in chunks):
        return seq_ids, input_ids, context_lens, chunks, 0
    # A verify row runs as decode queries, one per token, each over its context so far (the K/V of
    # the tokens before it is stored first, as a decode row's own): the decode kernel serves them,
    # and a step of decode and verify rows alone stays a decode step.
    verify = [chunk for chunk in chunks if chunk.num_draft_tokens]
    chunks = [chunk for chunk in chunks if not chunk.num_draft_tokens]
    verify_seq_ids, verify_tokens, verify_lens = [], [], []
    for chunk in verify:
        verify_seq_ids += [chunk.seq_id] * len(chunk.token_ids)
        verify_tokens += chunk.token_ids
        start = chunk.num_cached_tokens
        verify_lens += range(start + 1, start + len(chunk.token_ids) + 1)
    return (np.concatenate([seq_ids, np.array(verify_seq_ids, dtype=np.int64)]),
            np.concatenate([input_ids, np.array(verify_tokens, dtype=np.int64)]),
            np.concatenate([context_lens, np.array(verify_lens, dtype=np.int64)]), chunks, len(verify_tokens))


def row_slots(step: StepMessage, decode_chunks: list[PrefillChunk], prefill_chunks: list[PrefillChunk],
              num_padding: int) -> np.ndarray:
    """Each row's LoRA slot, in the order the input builder lays the rows out: decode rows, verify rows' queries,
    padding rows (-1), then prompt chunks' rows. A step made without slots (a warm-up's) runs the base model."""
    decode = np.frombuffer(step.decode_lora_slots, dtype=np.int64)
    columns = [decode if len(decode) == step.num_decode_rows else np.full(step.num_decode_rows, -1, dtype=np.int64)]
    columns += [np.full(len(chunk.token_ids), chunk.lora_slot, dtype=np.int64) for chunk in decode_chunks]
    columns.append(np.full(num_padding, -1, dtype=np.int64))
    columns += [np.full(len(chunk.token_ids), chunk.lora_slot, dtype=np.int64) for chunk in prefill_chunks]
    return np.concatenate(columns)
