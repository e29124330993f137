"""Speculative decoding's proposers: guesses of a sequence's next tokens, which one forward then verifies
(engine/scheduler.py plans the verify rows, postprocess keeps the accepted tokens).

A proposer only guesses; verification alone decides the tokens, so a bad guess costs time, never a
different token. Which requests may speculate is decided here too (speculates), in one place.
"""
from array import array
from typing import Protocol

from tpengine.config import SpeculativeConfig
from tpengine.sampling_params import SamplingParams


def speculates(params: SamplingParams) -> bool:
    """Whether a request's tokens can be verified exactly a few at a time. Penalties and min_tokens read the
    tokens before each one, logprobs and structured outputs are kept per step: such requests decode one token
    a step. Stop strings are matched token by token over a verify row's tokens, and the sequence cut at the
    one that completes a match (engine/request.py, Scheduler.truncate)."""
    return not (params.has_penalties or params.min_tokens or params.logprobs is not None
                or params.structured_outputs is not None)


# a draft the ledger leaves to the ranks' draft model (runner/drafter.py): the verify row carries only its
# number, and the tokens come back with the step's sampled ones
DRAFTED_ON_RANKS = -1


class Proposer(Protocol):
    """What the scheduler asks of a proposer: an n-gram lookup here on the ledger, or a model on the ranks (a
    draft model now; an EAGLE or MTP head would be another)."""

    on_ranks: bool  # its drafts are made on the ranks within the verifying step: propose returns placeholders
    # on the ranks: its K/V is written from a verify row's token context where it lacks it (a draft model), rather
    # than from every step's rows (MTP, which reads the model's hidden states)
    catches_up: bool

    def propose(self, token_ids: list[int], max_num_tokens: int) -> list[int]:
        """At most max_num_tokens guesses of the tokens that follow token_ids (none is fine); DRAFTED_ON_RANKS
        for each guess the ranks make."""
        ...


class NgramProposer:
    """Prompt lookup (vLLM's "ngram"): the longest suffix of the sequence, prompt_lookup_max down to
    prompt_lookup_min tokens, that occurred before; the tokens that followed its latest occurrence, repeated
    as a loop where they reach the sequence's end."""

    on_ranks = False
    catches_up = False

    def __init__(self, config: SpeculativeConfig):
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, token_ids: list[int], max_num_tokens: int) -> list[int]:
        num_tokens = len(token_ids)
        if max_num_tokens <= 0 or num_tokens <= self.min_n:
            return []
        # bytes.rfind searches in C; a hit must start on a token boundary (4 bytes)
        data = array("i", token_ids).tobytes()
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            suffix = data[-4 * n:]
            end = 4 * (num_tokens - 1)  # the occurrence must end before the last token: something follows it
            while True:
                at = data.rfind(suffix, 0, end)
                if at < 0:
                    break
                if at % 4 == 0:
                    return _continuation(token_ids, at // 4 + n, max_num_tokens)
                end = at + 4 * n - 1  # a hit across token boundaries: look further back
        return []


def _continuation(token_ids: list[int], start: int, max_num_tokens: int) -> list[int]:
    """Up to max_num_tokens tokens from start on; past the end, the ones from start again: the suffix that
    matched at start - n continues as it did (a loop of period len(token_ids) - start)."""
    proposal = token_ids[start:start + max_num_tokens]
    period = len(token_ids) - start
    while len(proposal) < max_num_tokens:
        proposal.append(proposal[len(proposal) - period])
    return proposal


class DraftModelProposer:
    """A draft model (vLLM's "draft_model"), or the checkpoint's own multi-token-prediction layer ("mtp"): every
    speculating sequence gets the most drafts it may have, which the ranks propose greedily in the step that
    verifies them (runner/drafter.py, runner/mtp_drafter.py)."""

    on_ranks = True

    def __init__(self, catches_up: bool = True):
        self.catches_up = catches_up

    def propose(self, token_ids: list[int], max_num_tokens: int) -> list[int]:
        return [DRAFTED_ON_RANKS] * max_num_tokens


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method in ("draft_model", "mtp"):
        return DraftModelProposer(catches_up=config.method == "draft_model")
    assert config.method == "ngram", "SpeculativeConfig.from_dict admits only the methods built"
    return NgramProposer(config)
