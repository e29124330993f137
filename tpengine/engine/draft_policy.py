"""Whether a step's running sequences should take drafts: speculative decoding pays where verifying k more
tokens per row costs less than the drafts it keeps, which depends on the batch (a large one is compute-bound
on a CPU), the model, the machine and how often the drafts are right. None of that is guessed here: steps
are measured.

For each class of batch sizes (powers of two), the output tokens per second per row of steps with drafts and
of steps without are followed as moving averages; a step takes drafts when those steps have been the faster,
and one step in EXPLORE_EVERY of its class does the other (one in 4x as many when the other is far behind),
so both figures stay current as the workload changes. Only steps without prompt chunks are measured (a
prefill's cost is another matter). The tokens are the same either way (verification is exact): this decides
speed only.
"""

EXPLORE_EVERY = 16   # one step in this many of a batch class runs the way that has been slower...
FAR_APART = 0.1      # ...and one in 4x as many while it has been slower by more than this fraction: a clear
                     # loser costs less to keep watching, and one step that changes the order is enough
SMOOTHING = 0.2      # weight of a new step in its moving average


class DraftPolicy:
    def __init__(self, disable_by_batch_size: int | None = None, adaptive: bool = True):
        self.disable_by_batch_size = disable_by_batch_size  # vLLM's: no drafts in a step of this many rows or more
        self.adaptive = adaptive
        # batch class -> [tokens/s/row of steps with drafts, of steps without], None until measured
        self._rates: dict[int, list[float | None]] = {}
        self._steps: dict[int, int] = {}

    def drafts_pay(self, num_rows: int) -> bool:
        """Whether a step of num_rows decode rows should take drafts (called once per such step)."""
        if self.disable_by_batch_size is not None and num_rows >= self.disable_by_batch_size:
            return False
        if not self.adaptive:
            return True
        batch_class = num_rows.bit_length()
        step = self._steps[batch_class] = self._steps.get(batch_class, 0) + 1
        with_drafts, without = self._rates.get(batch_class, (None, None))
        # measure each way once first, without drafts first: a first step with drafts after steps without is the
        # dear one (the draft model writes the K/V its sequences missed), and a batch class that never pays
        # should pay it only when it explores
        if with_drafts is None or without is None:
            return without is not None
        faster = with_drafts >= without
        every = EXPLORE_EVERY if abs(with_drafts - without) < FAR_APART * max(with_drafts, without) \
            else 4 * EXPLORE_EVERY
        return faster != (step % every == 0)

    def observe(self, num_rows: int, drafted: bool, num_new_tokens: int, seconds: float) -> None:
        """A step of num_rows decode or verify rows (no prompt chunk), with drafts or without, appended
        num_new_tokens tokens in seconds."""
        if not self.adaptive or num_rows <= 0 or seconds <= 0:
            return
        rate = num_new_tokens / seconds / num_rows
        rates = self._rates.setdefault(num_rows.bit_length(), [None, None])
        arm = 0 if drafted else 1
        rates[arm] = rate if rates[arm] is None else (1 - SMOOTHING) * rates[arm] + SMOOTHING * rate
