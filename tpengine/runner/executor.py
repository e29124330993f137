"""Rank 0's view of all ranks: send a step everywhere, run rank 0's part, hand back the sampled token ids."""
from tpengine.config import EngineConfig
from tpengine.distributed.messages import StepMessage
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

    @property
    def num_kvcache_blocks(self) -> int:
        return self.runner.num_kvcache_blocks

    def send_to_workers(self, step: StepMessage) -> None:
        """Hand the step to the other ranks before rank 0 runs its own part."""

    @property
    def max_num_batched_tokens(self) -> int:
        """Most tokens one forward takes: the setting, or the device's default."""
        return self.runner.max_num_batched_tokens

    def execute(self, plan) -> SamplerOutput:
        """Run a StepPlan on every rank; one sampled token per record of plan.sampling."""
        self._send(plan)
        return self.runner.execute(plan.message, plan.sampling)

    def _send(self, plan) -> None:
        step, records = plan.message, plan.sampling
        # The one place the sampling path is chosen: every rank (of the last stage) samples its own slice of
        # the vocabulary when every row is shaped by its temperature alone (and no min_tokens masks its stop
        # tokens); else rank 0 samples the gathered logits. Either way a row gets the same token.
        if (records and self.runner.samples_vocab_parallel
                and all(record.plain and not record.min_tokens_pending for record in records)):
            step.temperatures, step.uniforms, step.masked_rows, step.token_masks = self.sampler.vocab_parallel_rows(
                records, self.runner.hf_config.vocab_size)
        self.send_to_workers(step)

    # --- pipeline parallelism: up to pipeline_parallel_size steps in flight ---------------------

    def submit(self, plan) -> None:
        """Send a step down the pipeline and run the first stage's part; its tokens come from collect(plan),
        steps in the order they were submitted."""
        self._send(plan)
        self.runner.execute(plan.message)

    def collect(self, plan) -> SamplerOutput:
        """The tokens of the oldest step submitted and not yet collected: plan."""
        return self.runner.sampled_by_last_stage(plan.message, plan.sampling)

    def check_open(self) -> None:
        """Raise if the engine was shut down (rank 0 alone: it never is between steps)."""

    def check_health(self) -> None:
        """Raise if some rank is gone (rank 0 alone: nothing to check)."""

    def shutdown(self, graceful: bool = True) -> None:
        pass
