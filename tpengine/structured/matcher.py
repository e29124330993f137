"""A completion's place in its grammar, and the masks a step's constrained rows get from theirs (rank 0)."""
import torch
import xgrammar as xgr

from tpengine.kernels.cpu import token_bitmask
from tpengine.structured.utf8_guard import SurrogateGuard
from tpengine.thinking import thinking_open_after


class SequenceGrammar:
    """One completion's grammar matcher: it masks the completion's next token and takes each one sampled.

    With a reasoning model the grammar constrains the answer only, where tpengine/thinking.py's rule puts it: not
    while thinking the prompt left open runs, nor, in a chat reply (may_open_thinking), after a first token
    <think>, until </think>. Such a reply's first token is masked to the grammar's tokens and <think>.
    """

    __slots__ = ("matcher", "think_end", "opening_token", "active", "guard", "after_lead")

    def __init__(self, compiled_grammar, reasoning_tokens: tuple[int, int] | None = None,
                 prompt_token_ids: list[int] = (), may_open_thinking: bool = False,
                 guard: SurrogateGuard | None = None):
        self.matcher = xgr.GrammarMatcher(compiled_grammar)
        self.guard = guard            # what the grammar lets through and UTF-8 does not (utf8_guard.py)
        self.after_lead = False       # the last token ended on a lone ED: no surrogate may follow
        self.think_end = None
        self.opening_token = None  # <think>, which the first token may be instead of the grammar's
        self.active = True
        if reasoning_tokens is not None:
            think_start, self.think_end = reasoning_tokens
            self.active = not thinking_open_after(prompt_token_ids, think_start, self.think_end)
            if self.active and may_open_thinking:
                self.opening_token = think_start

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it (the mask should have)."""
        if not self.active:
            self.active = token_id == self.think_end
            return True
        if self.opening_token is not None:  # the first token: it may open the thinking
            opened, self.opening_token = token_id == self.opening_token, None
            if opened:
                self.active = False
                return True
        if self.guard is not None:
            self.after_lead = token_id in self.guard.leaves_lead
        return self.matcher.accept_token(token_id)


_batch_matcher: xgr.BatchGrammarMatcher | None = None


def fill_bitmask(num_rows: int, vocab_size: int, rows: list[int], grammars: list[SequenceGrammar]) -> torch.Tensor:
    """xgrammar's int32 token bitmask [num_rows, words] (on the host): rows[i]'s bits say which tokens grammars[i]
    allows next, the other rows allow every token."""
    global _batch_matcher
    bitmask = xgr.allocate_token_bitmask(num_rows, vocab_size)
    if len(rows) == 1:
        grammars[0].matcher.fill_next_token_bitmask(bitmask, rows[0])
    else:  # the rows' masks filled by xgrammar's threads
        if _batch_matcher is None:
            _batch_matcher = xgr.BatchGrammarMatcher()
        _batch_matcher.batch_fill_next_token_bitmask([g.matcher for g in grammars], bitmask, rows)
    words = bitmask.numpy().view("uint32")
    for row, grammar in zip(rows, grammars):
        if grammar.guard is not None and grammar.active:
            grammar.guard.restrict(words[row], grammar.after_lead)
        if grammar.opening_token is not None:  # a chat reply's first token may open its thinking instead
            word, bit = divmod(grammar.opening_token, 32)
            words[row, word] |= 1 << bit
    return bitmask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set to -inf, in place, every logit of `rows` that its bitmask row does not allow (the model's vocabulary
    beyond the tokenizer's included: the grammars were compiled for the model's)."""
    if logits.device.type == "cpu" and logits.stride(1) == 1 and token_bitmask.available():
        token_bitmask.apply_token_bitmask(logits, bitmask, rows)  # whole words at a time: ~1 ms a row less
        return
    if logits.device.type != "cpu":
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.size(1), indices=rows)

