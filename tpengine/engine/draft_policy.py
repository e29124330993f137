"""Whether a step's running sequences should take drafts: speculative decoding pays where verifying k more
tokens per row costs less than the drafts it keeps, which depends on the batch (a large one is compute-bound
on a CPU), the model, the machine and how often the drafts are right. None of that is guessed here: steps
are measured.

For each class of batch sizes (powers of two), the output tokens per second a row gets from steps with drafts
and from steps without are followed as moving averages (while no request waits for a row, a step with drafts
counts the mean tokens of its slower half of rows: a batch that is not refilled ends with its slower rows); a
step takes drafts when those steps have been the faster, and now and then one step does the other, so both
figures stay current as the workload changes. Exploring
is dear (a verify step at a large batch costs several plain ones, and the rows it moves on unevenly leave the
batch ragged), so its interval backs off: it starts at EXPLORE_EVERY steps of the class and grows 2x each
time an exploring step confirms the order (4x when the ways are far apart), up to MAX_EXPLORE_EVERY; a step
that changes the order starts it over. An exploring step's figure replaces its way's average, which is as old
as the exploring step before. Only steps without prompt chunks are measured (a prefill's cost is
another matter). The tokens are the same either way (verification is exact): this decides speed only.
"""

EXPLORE_EVERY = 16         # steps of a batch class between exploring steps at first...
MAX_EXPLORE_EVERY = 1024   # ...and at most, once exploring keeps confirming the order
FAR_APART = 0.1            # the ways differ by more than this fraction: the interval grows 4x, not 2x
SMOOTHING = 0.2            # weight of a new step in its moving average


class _BatchClass:
    """What the policy knows of one class of batch sizes."""

    __slots__ = ("rates", "steps", "interval", "next_explore", "exploring")

    def __init__(self):
        self.rates: list[float | None] = [None, None]  # tokens/s/row of steps with drafts, of steps without
        self.steps = 0
        self.interval = EXPLORE_EVERY
        self.next_explore = EXPLORE_EVERY
        self.exploring: bool | None = None  # the way an exploring step took (drafted or not) until it is measured


class DraftPolicy:
    def __init__(self, disable_by_batch_size: int | None = None, adaptive: bool = True):
        self.disable_by_batch_size = disable_by_batch_size  # vLLM's: no drafts in a step of this many rows or more
        self.adaptive = adaptive
        self._classes: dict[int, _BatchClass] = {}

    def _class(self, num_rows: int) -> _BatchClass:
        batch_class = self._classes.get(num_rows.bit_length())
        if batch_class is None:
            batch_class = self._classes[num_rows.bit_length()] = _BatchClass()
        return batch_class

    def drafts_pay(self, num_rows: int) -> bool:
        """Whether a step of num_rows decode rows should take drafts (called once per such step)."""
        if self.disable_by_batch_size is not None and num_rows >= self.disable_by_batch_size:
            return False
        if not self.adaptive:
            return True
        batch_class = self._class(num_rows)
        batch_class.steps += 1
        with_drafts, without = batch_class.rates
        # measure each way once first, without drafts first: a first step with drafts after steps without is the
        # dear one (the draft model writes the K/V its sequences missed), and a batch class that never pays
        # should pay it only when it explores
        if with_drafts is None or without is None:
            return without is not None
        faster = with_drafts >= without
        if batch_class.steps < batch_class.next_explore:
            return faster
        batch_class.exploring = not faster
        batch_class.next_explore = batch_class.steps + batch_class.interval  # until the step is measured
        return not faster

    def observe(self, num_rows: int, drafted: bool, tokens_per_row: float, seconds: float) -> None:
        """A step of num_rows decode or verify rows (no prompt chunk), with drafts or without, took seconds and
        counts tokens_per_row tokens a row (the scheduler says which: engine/scheduler.py, observe_step)."""
        if not self.adaptive or num_rows <= 0 or seconds <= 0:
            return
        rate = tokens_per_row / seconds
        batch_class = self._class(num_rows)
        rates = batch_class.rates
        arm = 0 if drafted else 1
        explored = batch_class.exploring is not None and batch_class.exploring == drafted
        # an exploring step restarts its way's average: the figure it had is as old as the last exploring step
        rates[arm] = rate if rates[arm] is None or explored else (1 - SMOOTHING) * rates[arm] + SMOOTHING * rate
        if not explored:
            return
        batch_class.exploring = None
        with_drafts, without = rates
        if (with_drafts >= without) == drafted:  # the way explored is now the faster: look again soon
            batch_class.interval = EXPLORE_EVERY
        else:
            far = abs(with_drafts - without) > FAR_APART * max(with_drafts, without)
            batch_class.interval = min(batch_class.interval * (4 if far else 2), MAX_EXPLORE_EVERY)
        batch_class.next_explore = batch_class.steps + batch_class.interval
