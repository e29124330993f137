"""Rank 0's view of all ranks: send a step everywhere, run rank 0's part, hand back the sampled token ids."""
from tpengine.config import EngineConfig
from tpengine.distributed.messages import StepMessage
from tpengine.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup, resolve_device
from tpengine.runner.model_runner import ModelRunner
from tpengine.runner.sampler import Sampler, SamplerOutput


class Executor:
    """tp=1: rank 0 alone. MultiprocExecutor adds the workers."""

    def __init__(self, config: EngineConfig, group: TensorParallelGroup = SINGLE_RANK, device=None):
        self.config = config
        self.sampler = Sampler(config.seed, config.tensor_parallel_size)
        self.runner = ModelRunner(config, group, device or resolve_device(config.device), self.sampler)

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
        step, records = plan.message, plan.sampling
        # The one place the sampling path is chosen: every rank samples its own slice of the vocabulary
        # when every row is shaped by its temperature alone (and no min_tokens masks its stop tokens);
        # else rank 0 samples the gathered logits. Either way a row gets the same token.
        if (records and self.runner.samples_vocab_parallel
                and all(record.plain and not record.min_tokens_pending for record in records)):
            step.temperatures, step.uniforms = self.sampler.vocab_parallel_rows(records)
        self.send_to_workers(step)
        return self.runner.execute(step, records)

    def check_health(self) -> None:
        """Raise if some rank is gone (rank 0 alone: nothing to check)."""

    def shutdown(self) -> None:
        pass
