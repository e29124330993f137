"""Rank 0's view of all ranks: run a step everywhere, sample (on rank 0, or on every rank over its slice of
the vocabulary), hand back token ids."""
from tpengine.config import EngineConfig
from tpengine.distributed.messages import StepMessage, slim_step
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
        """Run a StepPlan on every rank; one sampled token per row of plan.seqs."""
        step = slim_step(plan)
        rows = self.sampler.vocab_parallel_rows(plan.seqs) if self.runner.samples_vocab_parallel else None
        if rows is not None:
            step.temperatures, step.uniforms = rows
        self.send_to_workers(step)
        out = self.runner.execute(step)
        if rows is not None:
            return SamplerOutput(out, [None] * len(plan.seqs))
        return self.sampler(out, plan.seqs)

    def check_health(self) -> None:
        """Raise if some rank is gone (rank 0 alone: nothing to check)."""

    def shutdown(self) -> None:
        pass
