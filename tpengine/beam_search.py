"""One prompt's beam search, as plain bookkeeping: LLM.beam_search asks the engine for every running beam's
next-token logprobs each round and hands them to advance(). The rules are transformers' beam search
(generate(num_beams=beam_width, do_sample=False)), so its sequences are transformers' on the same logits."""
from dataclasses import dataclass, field
from itertools import islice

from tpengine.sampling_params import BeamSearchParams


@dataclass
class BeamSearchSequence:
    """One beam (vLLM's record): its token ids, prompt included, and what it scored."""
    tokens: list[int]
    # per output token: the logprobs of the candidates it was chosen among (token id -> log-probability)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None                 # set once the search ends (None without a tokenizer)
    finish_reason: str | None = None        # "stop" (it ended on EOS) or "length" (it reached max_tokens)


@dataclass
class BeamSearchOutput:
    """A prompt's beam_width finished beams, best first by the length-penalized score."""
    sequences: list[BeamSearchSequence]


@dataclass
class _Hypothesis:
    score: float                            # cum_logprob / num_output_tokens ** length_penalty
    sequence: BeamSearchSequence


class BeamSearch:
    """vLLM's BeamSearchInstance, with transformers' rules: each round the running beams' candidates are
    ranked by cumulative logprob; those among the best beam_width that end (an EOS token, or the last
    round) join the finished hypotheses, scored by length penalty, of which the best beam_width are kept;
    the best beam_width candidates that do not end run on."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids: frozenset[int]):
        self.params = params
        self.num_prompt_tokens = len(prompt_token_ids)
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.running = [BeamSearchSequence(tokens=list(prompt_token_ids))]
        self.finished: list[_Hypothesis] = []  # best first, at most beam_width

    @property
    def num_logprobs(self) -> int:
        """Candidates each beam needs: its best beam_width that do not end, so beam_width past its EOS tokens."""
        return self.params.beam_width + len(self.eos_token_ids)

    @property
    def done(self) -> bool:
        return not self.running

    def advance(self, next_logprobs: list[dict[int, float]]) -> None:
        """One round: next_logprobs[i] holds running beam i's num_logprobs likeliest next tokens."""
        params, width = self.params, self.params.beam_width
        num_output_tokens = len(self.running[0].tokens) - self.num_prompt_tokens + 1
        last = num_output_tokens == params.max_tokens
        # ties go to the earlier beam, then the smaller token id (transformers' order over beam * vocab)
        candidates = sorted(((beam.cum_logprob + logprob, i, token) for i, (beam, logprobs)
                             in enumerate(zip(self.running, next_logprobs)) for token, logprob in logprobs.items()),
                            key=lambda c: (-c[0], c[1], c[2]))
        for cum_logprob, i, token in candidates[:width]:
            if last or token in self.eos_token_ids:
                sequence = self._extend(i, token, cum_logprob, next_logprobs[i])
                sequence.finish_reason = "stop" if token in self.eos_token_ids else "length"
                self.finished.append(_Hypothesis(cum_logprob / num_output_tokens ** params.length_penalty, sequence))
        self.finished.sort(key=lambda h: -h.score)
        del self.finished[width:]
        if last:
            self.running = []
            return
        self.running = [self._extend(i, token, cum_logprob, next_logprobs[i]) for cum_logprob, i, token
                        in islice((c for c in candidates if c[2] not in self.eos_token_ids), width)]
        # transformers' stop: beam_width have finished, and early_stopping=True, or no running beam can beat them
        if self.running and len(self.finished) == width and (
                params.early_stopping is True
                or self._best_possible_score(num_output_tokens) <= self.finished[-1].score):
            self.running = []

    def _best_possible_score(self, num_output_tokens: int) -> float:
        """transformers' bound on what the best running beam could still score: at its present length, or for
        "never" with a positive length penalty at max_tokens (a true bound there: logprobs are <= 0)."""
        params = self.params
        length = params.max_tokens if params.early_stopping == "never" and params.length_penalty > 0 else \
            num_output_tokens
        return self.running[0].cum_logprob / length ** params.length_penalty

    def _extend(self, i: int, token: int, cum_logprob: float, logprobs: dict[int, float]) -> BeamSearchSequence:
        beam = self.running[i]
        return BeamSearchSequence(tokens=beam.tokens + [token], logprobs=beam.logprobs + [logprobs],
                                  cum_logprob=cum_logprob)

    def output(self) -> BeamSearchOutput:
        """The finished beams, best first (after the search is done)."""
        return BeamSearchOutput(sequences=[h.sequence for h in self.finished])
