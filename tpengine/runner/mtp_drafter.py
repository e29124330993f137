"""Speculative decoding's MTP drafter on one rank (DeepSeek V3's multi-token-prediction layer, models/deepseek.py):
the layer guesses token p + 2 from the model's hidden state at p and token p + 1, so unlike a draft model it reads
the model's own hidden states, which exist only in the step that computed them.

So the drafter keeps, per sequence, the hidden states of the rows the model last ran for it (a run: their positions,
tokens and hidden states), and writes the layer's K/V for those positions in the sequence's next step, once the token
after the run's last is known (the step's first token of that sequence; a verify row's accepted drafts are the run's
own tokens up to it). That catch-up forward's last row per sequence is the layer's guess at the sequence's next token
but one: a verify row's first draft. Each further draft feeds the layer its own output as the hidden state (vLLM's
reuse of one MTP layer for several drafts), one decode forward each, over slots the ledger gave the verify row; the
next step's catch-up overwrites those with the accepted tokens' K/V.

A sequence with no run reaching its step (its first prompt chunk, a run dropped after preemption) has no K/V written
for those positions: its guesses are worse, its tokens the same. Every rank computes the same greedy drafts
(greedy_on_every_rank): they reach the ledger with rank 0's sampled tokens.
"""
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from tpengine.distributed.messages import PrefillChunk, StepMessage, int_column
from tpengine.runner.inputs import ForwardInputs, InputBuilder, decode_columns
from tpengine.runner.kv_cache import attention_layers_of
from tpengine.runner.sampler import greedy_on_every_rank


@dataclass
class HiddenRun:
    """The model's rows for one sequence in its last step: positions start.., their tokens and hidden states."""
    start: int
    tokens: list[int]
    hidden: torch.Tensor  # [len(tokens), hidden], a copy (the forward's output buffer is reused)


class MtpDrafter:
    def __init__(self, model: torch.nn.Module, group):
        self.model = model  # DeepseekMtp, sharing the model's embedding and LM head
        self.group = group
        self.attention_layers = attention_layers_of(model)  # their cache: the model's blocks (runner/kv_cache.py)
        self.runs: dict[int, HiddenRun] = {}

    def prepare(self, step: StepMessage, inputs: InputBuilder) -> tuple[StepMessage, ForwardInputs, list[int]]:
        """The layer's K/V for the positions the model computed last step (and its first drafts), each verify row
        given its drafts; the step's forward inputs, and those drafts, row after row."""
        inputs.block_tables.update(step)
        if step.reset_tables:
            self.runs.clear()
        for seq_id in step.released:
            self.runs.pop(seq_id, None)
        last_rows = self._catch_up(step, inputs)
        step, draft_token_ids = self._propose(step, inputs, last_rows)
        return step, inputs.build(step), draft_token_ids

    def forget_all(self) -> None:
        """Drop every sequence's run (after the warm-up's dummy sequences)."""
        self.runs.clear()

    def follow(self, step: StepMessage, hidden_states: torch.Tensor) -> None:
        """After the model's forward: each sequence's rows become its run."""
        for seq_id, start, tokens, first_row in _sequence_rows(step, hidden_states.size(0)):
            self.runs[seq_id] = HiddenRun(start, tokens, hidden_states[first_row:first_row + len(tokens)].clone())

    def _catch_up(self, step: StepMessage, inputs: InputBuilder) -> dict[int, torch.Tensor]:
        """One forward over every sequence's run up to the position before its first row in this step (whose token
        is that row's); each such sequence's last output row, the layer's h there."""
        chunks, hidden = [], []
        for seq_id, position, token in _first_rows(step):
            run = self.runs.pop(seq_id, None)
            if run is None or not run.start < position <= run.start + len(run.tokens):
                continue  # nothing of it kept, or another stretch of positions (recomputed after preemption)
            num_rows = position - run.start
            chunks.append(PrefillChunk(seq_id, run.tokens[1:num_rows] + [token], run.start, False))
            hidden.append(run.hidden[:num_rows])
        if not chunks:
            return {}
        forward = inputs.build(StepMessage(prefill=chunks))
        out = self._forward(forward, torch.cat(hidden), forward.meta.num_decode_tokens)
        ends = np.cumsum([len(chunk.token_ids) for chunk in chunks]) + forward.meta.num_decode_tokens
        return {chunk.seq_id: out[end - 1] for chunk, end in zip(chunks, ends)}

    def _forward(self, forward: ForwardInputs, hidden: torch.Tensor, first_row: int) -> torch.Tensor:
        """The layer over forward's rows, whose previous hidden states are hidden from first_row on (zeros on
        padding rows)."""
        previous = hidden.new_zeros(forward.input_ids.size(0), hidden.size(-1))
        previous[first_row:first_row + hidden.size(0)] = hidden
        return self.model(forward.input_ids, forward.positions, forward.meta, previous)

    def _propose(self, step: StepMessage, inputs: InputBuilder,
                 last_rows: dict[int, torch.Tensor]) -> tuple[StepMessage, list[int]]:
        """Each verify row's drafts: the first from its catch-up's last row, each next one from the layer's output
        for the one before (a decode forward per draft)."""
        wanted = [i for i, chunk in enumerate(step.prefill) if chunk.num_draft_tokens and len(chunk.token_ids) == 1]
        if not wanted:
            return step, []
        chunks = [step.prefill[i] for i in wanted]
        lacking = [chunk for chunk in chunks if chunk.seq_id not in last_rows]
        if lacking:  # no run to start from: the layer at the position before, from a zero hidden state
            out = self._decode_rows(inputs, lacking, [chunk.token_ids[0] for chunk in lacking], 0,
                                    torch.zeros(len(lacking), self.model.enorm.weight.size(0),
                                                dtype=self.model.enorm.weight.dtype))
            last_rows.update({chunk.seq_id: out[i] for i, chunk in enumerate(lacking)})
        hidden = [last_rows[chunk.seq_id] for chunk in chunks]  # each row's h at its latest position
        drafts: list[list[int]] = [[] for _ in chunks]
        for j in range(max(chunk.num_draft_tokens for chunk in chunks)):
            rows = [r for r, chunk in enumerate(chunks) if chunk.num_draft_tokens > j]
            if j:  # draft j + 1: the layer one position on, fed draft j and its own h
                out = self._decode_rows(inputs, [chunks[r] for r in rows], [drafts[r][-1] for r in rows], j,
                                        torch.stack([hidden[r] for r in rows]))
                for i, r in enumerate(rows):
                    hidden[r] = out[i]
            logits = self.model.compute_logits(torch.stack([hidden[r] for r in rows]), len(rows))
            for r, token in zip(rows, greedy_on_every_rank(logits.float(), self.group,
                                                           self.model.lm_head.vocab_start_idx)):
                drafts[r].append(token)
        prefill = list(step.prefill)
        for i, chunk, proposed in zip(wanted, chunks, drafts):
            prefill[i] = msgspec.structs.replace(chunk, token_ids=[chunk.token_ids[0], *proposed],
                                                 num_draft_tokens=len(proposed))
        return msgspec.structs.replace(step, prefill=prefill), [t for proposed in drafts for t in proposed]

    def _decode_rows(self, inputs: InputBuilder, chunks: list[PrefillChunk], tokens: list[int], offset: int,
                     hidden: torch.Tensor) -> torch.Tensor:
        """The layer for each verify row at position num_cached_tokens - 1 + offset, given its token there and the
        hidden state before: one decode forward; its output rows."""
        decode = StepMessage(int_column([chunk.seq_id for chunk in chunks]), int_column(tokens),
                             int_column([chunk.num_cached_tokens + offset for chunk in chunks]))
        forward = inputs.build(decode)
        return self._forward(forward, hidden.to(forward.input_ids.device), 0)[:len(chunks)]


def _first_rows(step: StepMessage) -> list[tuple[int, int, int]]:
    """(sequence, position, token) of each sequence's first row in the step."""
    seq_ids = np.frombuffer(step.decode_seq_ids, dtype=np.int64).tolist()
    tokens = np.frombuffer(step.decode_tokens, dtype=np.int64).tolist()
    context_lens = np.frombuffer(step.decode_context_lens, dtype=np.int64).tolist()
    rows = [(seq_id, context_len - 1, token) for seq_id, token, context_len in zip(seq_ids, tokens, context_lens)]
    return rows + [(chunk.seq_id, chunk.num_cached_tokens, chunk.token_ids[0]) for chunk in step.prefill]


def _sequence_rows(step: StepMessage, num_rows: int) -> list[tuple[int, int, list[int], int]]:
    """(sequence, first position, tokens, first row in the forward) of each sequence's rows in the step, as the
    input builder lays them out: decode rows, verify rows' queries, padding, then prompt chunks (the last rows)."""
    seq_ids, tokens, context_lens, chunks, _ = decode_columns(step)
    runs = []
    for row, (seq_id, token, context_len) in enumerate(zip(seq_ids.tolist(), tokens.tolist(), context_lens.tolist())):
        if runs and runs[-1][0] == seq_id and runs[-1][1] + len(runs[-1][2]) == context_len - 1:
            runs[-1][2].append(token)  # a verify row's next query
        else:
            runs.append((seq_id, context_len - 1, [token], row))
    row = num_rows - sum(len(chunk.token_ids) for chunk in chunks)
    for chunk in chunks:
        runs.append((chunk.seq_id, chunk.num_cached_tokens, list(chunk.token_ids), row))
        row += len(chunk.token_ids)
    return runs
