"""One scheduled step as a value: what the executor sends to every rank and what postprocess consumes."""
from dataclasses import dataclass, field

from tpengine.engine.sequence import Sequence


@dataclass(slots=True)
class StepPlan:
    """decode: running sequences, one token each (their last sampled one), every row sampled.
    prefill: prompt chunks, seq.num_scheduled_tokens tokens after its num_cached_tokens each; a row is
    sampled only where the chunk reaches the sequence's last token.
    The forward's rows are decode first, then prefill: the order of `seqs` and of the sampled tokens."""
    decode: list[Sequence] = field(default_factory=list)
    prefill: list[Sequence] = field(default_factory=list)
    block_copies: list[tuple[int, int, int]] = field(default_factory=list)  # (src, dst, num_tokens), before the forward
    # counted when the plan is made: postprocess resets the sequences' num_scheduled_tokens
    num_prefill_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_prefill_tokens = sum(seq.num_scheduled_tokens for seq in self.prefill)

    @property
    def seqs(self) -> list[Sequence]:
        return self.decode + self.prefill if self.prefill else self.decode

    @property
    def num_tokens(self) -> int:
        """Tokens through the forward: never more than the scheduler's max_num_batched_tokens."""
        return len(self.decode) + self.num_prefill_tokens

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)
