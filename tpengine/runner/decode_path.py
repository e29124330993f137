"""How a decode step's forward runs, chosen once when the runner starts: replayed from CUDA graphs
(cuda_graphs.py), replayed without the model's Python on the CPU (cpu_replay.py), or eagerly. Either way the
runner calls run() once a decode step; a step with prompt chunks always runs eagerly (model_runner.py)."""
import logging

import torch

from tpengine.attention.metadata import AttentionMetadata
from tpengine.distributed.parallel_state import one_gpu_test_mode
from tpengine.layers.fused_moe import FusedMoE
from tpengine.runner.cpu_replay import DecodeCpuReplays
from tpengine.runner.cuda_graphs import DecodeCudaGraphs

logger = logging.getLogger("tpengine")


class EagerDecode:
    """The model's own forward, every decode step."""

    replays = None

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)


class ReplayedDecode:
    """Recorded forwards (CUDA graphs or CPU replays, which share can_run and run), and the model's own forward
    for a step none holds: more rows than the largest bucket, a wider block table, a bucket that cannot replay."""

    def __init__(self, model: torch.nn.Module, replays: DecodeCudaGraphs | DecodeCpuReplays):
        self.model = model
        self.replays = replays

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        replays = self.replays
        if replays.can_run(input_ids.size(0), meta.block_tables.size(1)):
            return replays.run(input_ids, positions, meta)
        return self.model(input_ids, positions, meta)


def choose_decode_path(runner) -> EagerDecode | ReplayedDecode:
    """The path for a ModelRunner whose model, KV cache and input builder are ready (a CUDA graph captures the
    forward over them)."""
    replays = None
    if runner.device.type == "cuda":
        replays = _cuda_graphs(runner)
    elif runner.device.type == "cpu":
        replays = _cpu_replays(runner)
    return EagerDecode(runner.model) if replays is None else ReplayedDecode(runner.model, replays)


def _cuda_graphs(runner) -> DecodeCudaGraphs | None:
    config = runner.config
    # a graph captures NCCL collectives, not gloo's (the one-GPU test mode): those ranks stay eager; a
    # pipeline stage's decode runs eagerly too (its inputs are the previous stage's hidden states)
    if config.enforce_eager or (runner.group.size > 1 and one_gpu_test_mode()) or runner.pipeline.size > 1:
        return None
    if not runner.attention_backend.cuda_graph_safe:
        if runner.rank == 0:
            logger.info("no CUDA graphs with the %s attention backend (its store or decode syncs with the "
                        "host): decode runs eagerly", runner.backend_name)
        return None
    spec = config.speculative_config
    return DecodeCudaGraphs(runner.model, runner.hf_config.hidden_size, runner.dtype, runner.device,
                            config.max_num_seqs, runner.max_num_blocks_per_seq, runner.block_size,
                            0 if spec is None else spec.num_speculative_tokens)


def _cpu_replays(runner) -> DecodeCpuReplays | None:
    config = runner.config
    # what a recording cannot see rules a replay out: pipeline stages (their sends), experts' routing in
    # Python, a drafter between the steps, a decode that reads host lists (cpu_replay.py); the tensor-parallel
    # all-reduce is a host call it keeps (parallel_state.py)
    if (config.enforce_eager or runner.pipeline.size > 1 or config.speculative_config is not None
            or not runner.attention_backend.decode_reads_only_tensors
            or any(isinstance(module, FusedMoE) for module in runner.model.modules())):
        return None
    return DecodeCpuReplays(runner.model, runner.inputs.row_bucket(config.max_num_seqs),
                            runner.max_num_blocks_per_seq, runner.block_size)
