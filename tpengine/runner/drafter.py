"""Speculative decoding's draft model on one rank: a small checkpoint with the model's vocabulary, sharded over
the same ranks, that proposes a verify row's drafts inside the step that verifies them.

Its K/V lives in its own cache tensor but in the model's blocks and slots: the ledger's block tables and block
copies serve both, and no block is ever allocated for the draft model alone. It follows decode rows only in
steps that draft, and prompt chunks only while steps draft (mirror_prompts: its share of a prefill, soon
needed), so a step without drafts costs what it costs without speculation. A step that drafts runs first
each verify row's context that its cache lacks (the tokens its sequence prefilled or decoded in steps that did
not draft, or took from the prefix cache, which the ledger sends with the row) in one prefill forward, then
each verify row's drafts, one decode forward each from the row's last token (propose), then the step's own
forward over every row (mirror), so the sequences whose draft K/V was complete stay so, the verify rows'
accepted drafts included. Every rank finds the same greedy token per row (greedy_on_every_rank), so the
proposals need no message: they reach the ledger with rank 0's sampled tokens.

Sharded rather than whole on each rank (tp = 1 per rank): the same layers, loader and collectives serve it,
its weights and cache take 1/tp of the memory on each rank, and a forward costs 1/tp of the compute; its
all-reduces add a latency per layer, which a draft a few layers deep keeps small.
"""
import msgspec
import torch

from tpengine.distributed.messages import PrefillChunk, StepMessage, int_column
from tpengine.runner.inputs import ForwardInputs, InputBuilder
from tpengine.runner.kv_cache import attention_layers_of
from tpengine.runner.sampler import greedy_on_every_rank


class Drafter:
    def __init__(self, model: torch.nn.Module, group):
        self.model = model
        self.group = group
        self.attention_layers = attention_layers_of(model)  # their cache: the model's blocks (runner/kv_cache.py)

    def prepare(self, step: StepMessage, inputs: InputBuilder) -> tuple[StepMessage, ForwardInputs, list[int]]:
        """A step's forward inputs with its verify rows' drafts proposed, and those drafts, row after row; the draft
        model's K/V brought up to the step's before the model's forward (mirror, or mirror_prompts)."""
        inputs.block_tables.update(step)  # the proposals' forwards read the step's tables
        step, draft_token_ids = self.propose(step, inputs)
        forward = inputs.build(step)
        if draft_token_ids:  # a step that drafts: the draft model's K/V follows the model's for every row
            self.mirror(forward.input_ids, forward.positions, forward.meta)
        elif step.prefill and step.draft_prompts:  # another: its prompt chunks only
            self.mirror_prompts(step, inputs)
        return step, forward, draft_token_ids

    def forget_all(self) -> None:
        """Drop what is kept of every sequence: a draft model keeps nothing between steps."""

    def follow(self, step: StepMessage, hidden_states: torch.Tensor) -> None:
        """After the model's forward: a draft model reads none of its hidden states (runner/mtp_drafter.py does)."""

    def mirror(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> None:
        """Run a drafting step's forward for its K/V alone (no logits): the draft model's cache keeps up with the
        model's for every sequence it was complete for."""
        self.model(input_ids, positions, meta)

    def mirror_prompts(self, step: StepMessage, inputs: InputBuilder) -> None:
        """A step that does not draft, while steps draft: the draft model's K/V for its prompt chunks alone (its
        decode rows are written when their sequences next draft), so a sequence that drafts soon need not write
        its prompt's then."""
        self._write_kv(step.prefill, inputs)

    def _write_kv(self, chunks: list[PrefillChunk], inputs: InputBuilder) -> None:
        """One prefill forward over chunks whose tables the step already set, for the draft model's K/V alone."""
        forward = inputs.build(StepMessage(prefill=chunks))
        self.model(forward.input_ids, forward.positions, forward.meta)

    def propose(self, step: StepMessage, inputs: InputBuilder) -> tuple[StepMessage, list[int]]:
        """The step with every verify row that left its drafts to the draft model (PrefillChunk: a last token
        alone) given them, and those drafts, row after row. The block tables are the step's already: the ledger
        gave each row slots for its drafts."""
        wanted = [i for i, chunk in enumerate(step.prefill) if chunk.num_draft_tokens and len(chunk.token_ids) == 1]
        if not wanted:
            return step, []
        chunks = [step.prefill[i] for i in wanted]
        lacking = [PrefillChunk(chunk.seq_id, chunk.draft_context, chunk.draft_context_start, False, 0,
                                chunk.long_rope) for chunk in chunks if chunk.draft_context]
        if lacking:  # the K/V the draft model's proposals attend to, before they are made
            self._write_kv(lacking, inputs)
        drafts: list[list[int]] = [[] for _ in chunks]
        tokens = [chunk.token_ids[0] for chunk in chunks]
        # forward j: the rows that want more than j drafts, each over its context so far (its last token at
        # position num_cached_tokens, then its drafts); the row's token after it is its next draft
        for j in range(max(chunk.num_draft_tokens for chunk in chunks)):
            rows = [r for r, chunk in enumerate(chunks) if chunk.num_draft_tokens > j]
            decode = StepMessage(int_column([chunks[r].seq_id for r in rows]), int_column([tokens[r] for r in rows]),
                                 int_column([chunks[r].num_cached_tokens + 1 + j for r in rows]))
            forward = inputs.build(decode)
            hidden_states = self.model(forward.input_ids, forward.positions, forward.meta)
            logits = self.model.compute_logits(hidden_states, False, len(rows))
            for r, token in zip(rows, greedy_on_every_rank(logits.float(), self.group,
                                                           self.model.lm_head.vocab_start_idx)):
                drafts[r].append(token)
                tokens[r] = token
        prefill = list(step.prefill)
        for i, chunk, proposed in zip(wanted, chunks, drafts):
            prefill[i] = msgspec.structs.replace(chunk, token_ids=[chunk.token_ids[0], *proposed],
                                                 num_draft_tokens=len(proposed))
        return msgspec.structs.replace(step, prefill=prefill), [t for proposed in drafts for t in proposed]
