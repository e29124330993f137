"""Rank 0's view of all ranks: send a step everywhere, run rank 0's part, hand back the sampled token ids."""
from collections import deque

from tpengine.config import EngineConfig
from tpengine.distributed.messages import StepEnvelope
from tpengine.distributed.parallel_state import SINGLE_RANK, PipelineGroup, TensorParallelGroup, resolve_device
from tpengine.runner.model_runner import ModelRunner
from tpengine.runner.sampler import Sampler, SamplerOutput


class Executor:
    """tp=1: rank 0 alone. MultiprocExecutor adds the workers, and the pipeline's stages."""

    closed = False

    def __init__(self, config: EngineConfig, group: TensorParallelGroup = SINGLE_RANK, device=None,
                 pipeline: PipelineGroup | None = None):
        self.config = config
        self.sampler = Sampler(config.seed, config.tensor_parallel_size)
        self.runner = ModelRunner(config, group, device or resolve_device(config.device), self.sampler, pipeline)
        # steps submitted and not yet collected, oldest first: each envelope, and its tokens when one stage has them
        self._in_flight: deque[tuple[StepEnvelope, SamplerOutput | None]] = deque()

    @property
    def num_kvcache_blocks(self) -> int:
        return self.runner.num_kvcache_blocks

    def send_to_workers(self, envelope: StepEnvelope) -> None:
        """Hand the step to the other ranks before rank 0 runs its own part."""

    @property
    def max_num_batched_tokens(self) -> int:
        """Most tokens one forward takes: the setting, or the device's default."""
        return self.runner.max_num_batched_tokens

    def _envelope(self, plan) -> StepEnvelope:
        """The plan's message as the scheduler made it, with the sampling path chosen here, the one place it is:
        every rank (of the last stage) samples its own slice of the vocabulary when every row is shaped by its
        temperature alone (and no min_tokens masks its stop tokens); else rank 0 samples the gathered logits.
        Either way a row gets the same token."""
        records = plan.sampling
        vocab_parallel = None
        if (records and self.runner.samples_vocab_parallel
                and all(record.plain and not record.min_tokens_pending for record in records)
                and not any(chunk.prompt_logprobs for chunk in plan.message.prefill)):  # those gather the logits
            vocab_parallel = self.sampler.vocab_parallel_rows(records, self.runner.hf_config.vocab_size)
        return StepEnvelope(plan.message, vocab_parallel)

    def execute(self, plan) -> SamplerOutput:
        """Run a StepPlan on every rank; one sampled token per record of plan.sampling."""
        self.submit(plan)
        return self.collect(plan)

    def submit(self, plan) -> None:
        """Send a step on its way: one stage runs it whole (its tokens wait for collect); a pipeline's first
        stage runs its part, and the later stages run theirs while rank 0 submits the next step."""
        envelope = self._envelope(plan)
        self.send_to_workers(envelope)
        if self.runner.pipeline.size == 1:
            self._in_flight.append((envelope, self.runner.execute(envelope, plan.sampling)))
        else:
            self.runner.execute(envelope)
            self._in_flight.append((envelope, None))

    def collect(self, plan) -> SamplerOutput:
        """The tokens of the oldest step submitted and not yet collected: plan's."""
        envelope, output = self._in_flight.popleft()
        assert envelope.step is plan.message, "steps are collected in the order they were submitted"
        return output if output is not None else self.runner.sampled_by_last_stage(envelope, plan.sampling)

    def abandon(self) -> None:
        """Forget the steps in flight (an interrupted step): rank 0 alone goes on from its ledger's undo."""
        self._in_flight.clear()

    def check_open(self) -> None:
        """Raise if the engine was shut down (rank 0 alone: it never is between steps)."""

    def check_health(self) -> None:
        """Raise if some rank is gone (rank 0 alone: nothing to check)."""

    def shutdown(self, graceful: bool = True) -> None:
        if self.runner.step_threads is not None:  # this process goes on: every thread of it is its own again
            self.runner.step_threads.restore()
