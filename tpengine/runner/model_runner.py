"""One rank's execution: its model shard, its KV-cache shard, and turning a step message into a forward pass."""
import logging
import os

import torch

from tpengine.attention import make_backend, resolve_backend_name
from tpengine.attention.kv_cache_dtype import is_fp8, kv_cache_torch_dtype
from tpengine.config import FP8_NEEDS_A_GPU, EngineConfig
from tpengine.distributed.messages import BlockTable, PrefillChunk, StepMessage
from tpengine.distributed.parallel_state import (PipelineGroup, TensorParallelGroup, building_model_for,
                                                 one_gpu_test_mode)
from tpengine.hf_config import load_hf_config, long_rope_threshold_of, max_positions_of, quantization_config_of
from tpengine.kernels.cpu import sampling as cpu_sampling
from tpengine.layers.fused_moe import FusedMoE
from tpengine.layers.linear import keep_weights_in
from tpengine.models.loader import OnlineQuantization, load_model
from tpengine.models.registry import model_class
from tpengine.paging import blocks_for
from tpengine.platforms import platform_for
from tpengine.runner.cpu_replay import DecodeCpuReplays
from tpengine.runner.cuda_graphs import DecodeCudaGraphs
from tpengine.runner.inputs import InputBuilder
from tpengine.runner.sampler import Sampler, SamplerOutput, sample_vocab_parallel
from tpengine.sampling_params import SamplingRecord

logger = logging.getLogger("tpengine")

DEFAULT_CPU_KVCACHE_GB = 4.0


def available_host_memory() -> int:
    """Bytes the host can still hand out without swapping (Linux MemAvailable; free pages elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def online_quantization(config: EngineConfig, platform, device: torch.device) -> OnlineQuantization | None:
    """How a float checkpoint's linears are quantized as they load, if the engine is told to."""
    if config.quantization is None:
        return None
    if config.quantization == "fp8":
        if not platform.runs_fp8_linears(device):
            raise ValueError(FP8_NEEDS_A_GPU.format(where=f"this {device.type} device"))
        return OnlineQuantization(8, None, "fp8", lm_head=False, fp8=True)  # inputs: e4m3 per token
    activation = platform.ONLINE_QUANTIZATION_ACTIVATION
    bits = 8 if config.quantization == "int8" else 4
    return OnlineQuantization(bits, None if bits == 8 else config.quantization_group_size, activation,
                              lm_head=config.quantize_lm_head)


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / (1 << 30):.2f} GiB"


def attention_layers_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "k_cache")]


def kv_block_bytes(attention_layers: list[torch.nn.Module], block_size: int, dtype: torch.dtype) -> int:
    layer = attention_layers[0]
    return len(attention_layers) * block_size * 2 * layer.num_kv_heads * layer.head_dim * dtype.itemsize


def allocate_kv_cache(attention_layers: list[torch.nn.Module], num_blocks: int, block_size: int,
                      dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One tensor for every layer's K and V, [2, layers, blocks, block_size, kv_heads, head_dim], each layer given
    its views. CUDA: zeroed once, so no stale NaN bit pattern in an unwritten slot reaches a masked-out
    product (0 * NaN) in the torch backend; CPU: not touched up front."""
    layer = attention_layers[0]
    shape = (2, len(attention_layers), num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
    allocate = torch.zeros if device.type == "cuda" else torch.empty
    kv_cache = allocate(shape, dtype=dtype, device=device)
    for i, layer in enumerate(attention_layers):
        layer.k_cache, layer.v_cache = kv_cache[0, i], kv_cache[1, i]
    return kv_cache


def free_kv_cache(attention_layers: list[torch.nn.Module]) -> torch.Tensor:
    empty = torch.tensor([])
    for layer in attention_layers:
        layer.k_cache = layer.v_cache = empty
    return empty


class ModelRunner:
    def __init__(self, config: EngineConfig, group: TensorParallelGroup, device: torch.device,
                 sampler: Sampler | None = None, pipeline: PipelineGroup | None = None):
        self.config = config
        self.sampler = sampler  # rank 0's: the warm-up measures its memory too
        self.group = group
        self.pipeline = pipeline = pipeline or PipelineGroup(tp_size=group.size, tp_rank=group.rank)
        self.stage = pipeline.stage
        self.rank = rank = pipeline.rank  # global: stage * tp + rank in the stage
        self.block_size = config.kvcache_block_size
        hf_config = load_hf_config(config.model)
        self.hf_config = hf_config
        self.device = device
        self.platform = platform_for(device)
        self.platform.set_up_rank(device, config.world_size)  # every stage's ranks share the host
        self.max_num_batched_tokens = config.max_num_batched_tokens or self.platform.DEFAULT_MAX_NUM_BATCHED_TOKENS
        self.dtype = self.platform.resolve_dtype(config.dtype, hf_config, log=rank == 0)
        self.weight_dtype = self.platform.linear_weight_dtype(config.dtype)  # None: the linears' weights are in dtype
        self.max_model_len = config.max_model_len  # the engine already bounded it by the model's positions
        # the cache's element: 1 byte for FP8, so the same memory holds 2x the tokens of a half-precision cache
        self.kv_cache_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype)
        self.backend_name = resolve_backend_name(config.attention_backend, self.device, self.block_size, self.dtype,
                                                 self.kv_cache_dtype)
        if rank == 0:
            logger.info("attention backend: %s on %s (%s, KV cache %s)", self.backend_name, self.device, self.dtype,
                        str(self.kv_cache_dtype).removeprefix("torch."))
        self.attention_backend = make_backend(self.backend_name)
        self.model = self.load(config.model, hf_config, self.attention_backend)
        self.attention_layers = attention_layers_of(self.model)
        if rank == 0 and is_fp8(self.kv_cache_dtype):
            # vLLM warns alike: with scales of 1.0, K/V beyond e4m3's range are clamped
            unscaled = all(layer.k_scale.item() == layer.v_scale.item() == 1.0 for layer in self.attention_layers)
            logger.info("FP8 KV cache: %s", "every scale 1.0 (the checkpoint has none): K/V beyond +-448 are clamped"
                        if unscaled else "each layer's K and V scales from the checkpoint")
        # speculative decoding with a draft model: its shard on this rank, and its own KV cache in the same blocks
        self.drafter = None
        spec = config.speculative_config
        if spec is not None and spec.method == "draft_model":
            from tpengine.runner.drafter import Drafter
            draft_hf_config = load_hf_config(spec.model)
            self.drafter = Drafter(self.load(spec.model, draft_hf_config, make_backend(self.backend_name)), group)
        # CUDA: what the largest prefill and one step's sampling need beyond the weights, kept free
        # when the cache is sized
        self.activation_peak_bytes = self._warm_up() if self.device.type == "cuda" else 0
        self.num_kvcache_blocks = self._num_kvcache_blocks()
        self._allocate_kv_cache(self.num_kvcache_blocks)
        self.inputs = self.input_builder()
        # CPU ranks sample a plain step over their own vocabulary slices, with no gather of the logits
        # (rank 0 decides per step: StepMessage.temperatures), when every rank has the kernel
        # (a pipeline's last stage samples them at any tp: only the tokens go back to rank 0, not the logits)
        self.samples_vocab_parallel = (self.device.type == "cpu" and (group.size > 1 or pipeline.size > 1)
                                       and self._all_ranks_min(int(cpu_sampling.available())) == 1)
        self.cuda_graphs = None
        # a graph captures NCCL collectives, not gloo's (the one-GPU test mode): those ranks stay eager; a
        # pipeline stage's decode runs eagerly too (its inputs are the previous stage's hidden states)
        if self.device.type == "cuda" and not config.enforce_eager and (group.size == 1 or not one_gpu_test_mode()) \
                and pipeline.size == 1:
            if self.attention_backend.cuda_graph_safe:
                self.cuda_graphs = DecodeCudaGraphs(
                    self.model, hf_config.hidden_size, self.dtype, self.device, config.max_num_seqs,
                    self._max_num_blocks_per_seq(), self.block_size,
                    0 if spec is None else spec.num_speculative_tokens)
            elif rank == 0:
                logger.info("no CUDA graphs with the %s attention backend (its store or decode syncs with the "
                            "host): decode runs eagerly", self.backend_name)
        self.cpu_replays = None
        # what a recording cannot see rules a replay out: pipeline stages (their sends), experts' routing in
        # Python, a drafter between the steps, a decode that reads host lists (cpu_replay.py); the tensor-parallel
        # all-reduce is a host call it keeps (parallel_state.py)
        if (self.device.type == "cpu" and not config.enforce_eager and pipeline.size == 1
                and spec is None and self.attention_backend.decode_reads_only_tensors
                and not any(isinstance(module, FusedMoE) for module in self.model.modules())):
            self.cpu_replays = DecodeCpuReplays(self.model, self.inputs.row_bucket(config.max_num_seqs),
                                                self._max_num_blocks_per_seq(), self.block_size)

    def input_builder(self) -> InputBuilder:
        """Step messages into this model's inputs (LongRoPE's rows rotated with the long set offset as its rotary
        cache wants them)."""
        return InputBuilder(self.block_size, self.device, long_rope_threshold_of(self.hf_config),
                            max_positions_of(self.hf_config))

    def load(self, path: str, hf_config, attention_backend) -> torch.nn.Module:
        """This rank's shard of a checkpoint (the model, or a draft model), loaded, quantized as the engine is
        told (a float checkpoint) or as its config says, and prepacked."""
        config, rank = self.config, self.rank
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device), building_model_for(self.group, self.stage):
                model = model_class(hf_config)(hf_config, attention_backend)
        finally:
            torch.set_default_dtype(default_dtype)
        quantization = quantization_config_of(hf_config)
        online = None if quantization is not None else online_quantization(config, self.platform, self.device)
        keep_fp8 = self.platform.runs_fp8_linears(self.device)
        if self.weight_dtype is not None:
            keep_weights_in(model, self.weight_dtype)
        load_model(model, path, quantization, online, keep_fp8)
        if rank == 0 and quantization is not None:
            fp8 = ("FP8 W8A8 linears" if keep_fp8 else "FP8 weights converted to float at load: no FP8 matmul here")
            logger.info("%s: quantized checkpoint: %s%s", path, quantization.describe(),
                        f" ({fp8})" if "e4m3" in quantization.describe() else "")
        elif rank == 0 and online is not None:
            logger.info("%s: weights quantized at load: %s, inputs %s", path, config.quantization, online.activation)
        for module in model.modules():  # the linears' weights in the form their platform multiplies fastest
            if hasattr(module, "prepack"):
                module.prepack(self.weight_dtype)
        self.platform.release_freed_memory()
        return model

    # --- KV cache -------------------------------------------------------------------------------

    def _block_bytes(self) -> int:
        """One block's K/V on this rank: the model's layers', and the draft model's, which uses the same blocks."""
        block_bytes = kv_block_bytes(self.attention_layers, self.block_size, self.kv_cache_dtype)
        if self.drafter is not None:
            block_bytes += kv_block_bytes(self.drafter.attention_layers, self.block_size, self.kv_cache_dtype)
        return block_bytes

    def _all_ranks_min(self, value: int) -> int:
        """The smallest of every rank's value: over the stage's tensor-parallel group, then every stage."""
        return self.pipeline.all_reduce_min(self.group.all_reduce_min(value, self.device), self.device)

    def _max_num_blocks_per_seq(self) -> int:
        return blocks_for(self.max_model_len, self.block_size)

    def _num_kvcache_blocks(self) -> int:
        num_blocks, problem = self._kvcache_blocks_that_fit()
        # every rank must agree on the ledger's size, and on failing: take the smallest (0 where one fails)
        agreed = self._all_ranks_min(0 if problem else num_blocks)
        if problem:
            raise ValueError(problem)
        if agreed < 1:
            raise ValueError(f"no room for a single KV-cache block of {self._block_bytes()} bytes on every rank; "
                             f"lower kvcache_block_size or free memory")
        return agreed

    def _kvcache_blocks_that_fit(self) -> tuple[int, str | None]:
        """The blocks this rank can hold, and why not when a setting asks for more than there is."""
        config = self.config
        block_bytes = self._block_bytes()
        if self.device.type == "cuda":
            # total * utilization, less what is in use now (weights, CUDA context, other processes) and
            # the activation peak the warm-up measured
            free, total = torch.cuda.mem_get_info(self.device)
            available = free - (1.0 - config.gpu_memory_utilization) * total - self.activation_peak_bytes
            where = f"GPU {self.device.index} at gpu_memory_utilization={config.gpu_memory_utilization}"
        else:
            ranks_on_host = self.config.world_size  # CPU ranks of one engine share the host's memory
            available = available_host_memory() / ranks_on_host
            where = f"this host per rank ({ranks_on_host} rank(s))"
        if config.num_kvcache_blocks is not None:
            need = config.num_kvcache_blocks * block_bytes
            if need > available:
                return 0, (f"num_kvcache_blocks={config.num_kvcache_blocks} needs a KV cache of {_gib(need)} per "
                           f"rank, but {_gib(max(available, 0))} is available on {where}")
            return config.num_kvcache_blocks, None
        if self.device.type == "cuda":
            budget = available
        elif config.kvcache_memory_gb is not None:
            budget = config.kvcache_memory_gb * (1 << 30)
            if budget > available:
                return 0, (f"kvcache_memory_gb={config.kvcache_memory_gb} asks for a KV cache of {_gib(budget)} per "
                           f"rank, but {_gib(available)} is available on {where}")
        else:
            budget = min(DEFAULT_CPU_KVCACHE_GB * (1 << 30), available)
        useful = config.max_num_seqs * self._max_num_blocks_per_seq()  # never more than the limits can use
        return max(0, min(useful, int(budget) // block_bytes)), None

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        try:
            self.kv_cache = allocate_kv_cache(self.attention_layers, num_blocks, self.block_size,
                                              self.kv_cache_dtype, self.device)
            if self.drafter is not None:
                self.drafter.kv_cache = allocate_kv_cache(self.drafter.attention_layers, num_blocks, self.block_size,
                                                          self.kv_cache_dtype, self.device)
        except RuntimeError as e:  # torch.OutOfMemoryError included: the sizing above misjudged what is free
            self._free_kv_cache()
            size = num_blocks * self._block_bytes()
            raise ValueError(f"could not allocate a KV cache of {num_blocks} blocks ({_gib(size)}) on "
                             f"{self.device}: {e}") from None

    def _free_kv_cache(self) -> None:
        self.kv_cache = free_kv_cache(self.attention_layers)
        if self.drafter is not None:
            self.drafter.kv_cache = free_kv_cache(self.drafter.attention_layers)

    def _warm_up(self) -> int:
        """Run the largest step the limits allow (building every kernel it needs); return its activation
        peak in bytes."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        cache_bytes = self.run_largest_step()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before - cache_bytes
        torch.cuda.empty_cache()
        return max(peak, 0)

    @torch.inference_mode()
    def run_largest_step(self) -> int:
        """The largest prefill step, then the LM head and (rank 0) sampling at max_num_seqs rows; returns
        the bytes of the scratch KV cache it used, which it frees again.

        The prefill is max_num_batched_tokens tokens, packed into sequences of at most max_model_len.
        Every rank runs it, so the collectives inside line up. A cache just big enough for it is
        allocated: some backends read the new keys back through the block table. A decode step can
        hold max_num_seqs sequences whatever max_num_batched_tokens is, so the logits and the sampler's
        full-vocabulary float32 and float64 rows are made for that many (about 1 GB at 512 x 151,936).
        """
        config = self.config
        num_tokens = min(self.max_num_batched_tokens, config.max_num_seqs * self.max_model_len)
        chunks, tables, num_blocks = [], [], 0
        for start in range(0, num_tokens, self.max_model_len):
            length = min(self.max_model_len, num_tokens - start)
            blocks = blocks_for(length, self.block_size)
            chunks.append(PrefillChunk(len(chunks), [0] * length, 0, True))
            tables.append(BlockTable(len(tables), list(range(num_blocks, num_blocks + blocks))))
            num_blocks += blocks
        step = StepMessage(prefill=chunks, new_tables=tables)
        inputs = self.input_builder().prepare(step)  # its own tables: none stay behind
        self._allocate_kv_cache(num_blocks)
        cache_bytes = num_blocks * self._block_bytes()
        from_previous_stage = None if self.stage.is_first else torch.zeros(
            2, num_tokens, self.hf_config.hidden_size, dtype=self.dtype, device=self.device)
        hidden_states = self.model(inputs.input_ids, inputs.positions, inputs.meta, from_previous_stage)
        if not self.stage.is_last:  # stages measure their own peaks: no pipeline traffic at warm-up
            del hidden_states
            self._free_kv_cache()
            return cache_bytes
        rows = torch.arange(config.max_num_seqs, device=self.device) % num_tokens
        logits = self.model.compute_logits(hidden_states[rows])
        if self.sampler is not None and logits is not None:
            self.sampler.warm_up(logits)
        del hidden_states, logits
        self._free_kv_cache()
        return cache_bytes

    def close(self) -> None:
        """Release CUDA graphs (captured graphs hold collectives) and their pool, and the CPU's replays (they hold
        the KV cache), and let queued work finish, before the caller tears down the group."""
        self.cuda_graphs = self.cpu_replays = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def copy_blocks(self, step: StepMessage) -> None:
        """Copy the heads of cached blocks into the blocks that reuse them (prefix hits that end inside a
        block, n > 1 completions forking their prompt): plain rows of the cache tensor, the same on every
        attention backend, done before any pass of the step writes or reads the cache."""
        for kv_cache in (self.kv_cache, *([self.drafter.kv_cache] if self.drafter is not None else [])):
            # [2, layers, blocks, block_size, kv_heads, head_dim]
            for copy in step.block_copies:
                kv_cache[:, :, copy.dst, :copy.num_tokens] = kv_cache[:, :, copy.src, :copy.num_tokens]

    # --- execution ------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, step: StepMessage, sampling: list[SamplingRecord] | None = None) -> SamplerOutput | None:
        """Run one step in one forward. Rank 0 (given the sampled rows' records) gets their tokens: sampled
        from its gathered logits, or, when the step carries temperatures, by every rank over its own slice
        of the vocabulary. Other ranks get None."""
        if step.block_copies:
            self.copy_blocks(step)
        if self.pipeline.size > 1:
            return self._execute_stage(step)
        draft_token_ids = []
        if self.drafter is None:
            inputs = self.inputs.prepare(step)
        else:  # between the tables' update and the inputs, the draft model proposes the verify rows' drafts
            self.inputs.block_tables.update(step)
            step, draft_token_ids = self.drafter.propose(step, self.inputs)
            inputs = self.inputs.build(step)
        input_ids, positions, meta, num_logits = inputs.input_ids, inputs.positions, inputs.meta, inputs.num_logits
        if draft_token_ids:  # a step that drafts: the draft model's K/V follows the model's for every row
            self.drafter.mirror(input_ids, positions, meta)
        elif self.drafter is not None and step.prefill and step.draft_prompts:  # another: its prompt chunks only
            self.drafter.mirror_prompts(step, self.inputs)
        graphs = self.cuda_graphs
        if meta.is_prefill:  # prompt chunks, with or without decode rows: eager
            hidden_states = self.model(input_ids, positions, meta)[inputs.logits_rows]
        elif graphs is not None and graphs.can_run(input_ids.size(0), meta.block_tables.size(1)):
            hidden_states = graphs.run(input_ids, positions, meta)
        elif self.cpu_replays is not None and self.cpu_replays.can_run(input_ids.size(0), meta.block_tables.size(1)):
            hidden_states = self.cpu_replays.run(input_ids, positions, meta)
        else:
            hidden_states = self.model(input_ids, positions, meta)
        if not num_logits:  # only chunks that end short of their prompts: nothing to sample
            return None if sampling is None else SamplerOutput([], [], draft_token_ids)
        # outside the graphs: on tp > 1 the LM head gathers every rank's slice of the vocabulary to rank 0,
        # unless every rank samples its own slice
        if step.temperatures:
            token_ids = sample_vocab_parallel(self.model.compute_logits(hidden_states, False, num_logits),
                                              step.temperatures, step.uniforms, self.group,
                                              self.model.lm_head.vocab_start_idx, step.masked_rows,
                                              step.token_masks)
            return None if token_ids is None else SamplerOutput(token_ids, [None] * num_logits, draft_token_ids)
        logits = self.model.compute_logits(hidden_states, num_rows=num_logits)
        if logits is None:
            return None
        output = self.sampler(logits, sampling)
        return output._replace(draft_token_ids=draft_token_ids) if draft_token_ids else output

    # --- pipeline parallelism -------------------------------------------------------------------

    def _execute_stage(self, step: StepMessage) -> None:
        """This stage's part of a step: the previous stage's hidden states in (unless first), its layers, and
        either the hidden states on to the next stage, or (the last) the step's tokens to rank 0: sampled here
        when the step carries temperatures, else the logits, which rank 0 samples with its records. Sends do not
        wait, so a stage takes the next step while the next stage runs this one."""
        inputs = self.inputs.prepare(step)
        stage, pipeline = self.stage, self.pipeline
        from_previous_stage = None
        if not stage.is_first:
            shape = (2, inputs.input_ids.size(0), self.hf_config.hidden_size)
            from_previous_stage = pipeline.recv_from_previous_stage(shape, self.dtype, self.device, step.virtual_engine)
        hidden_states = self.model(inputs.input_ids, inputs.positions, inputs.meta, from_previous_stage)
        if not stage.is_last:
            pipeline.send_to_next_stage(hidden_states, step.virtual_engine)
            return None
        num_logits = inputs.num_logits
        if not num_logits:
            return None
        if inputs.meta.is_prefill:
            hidden_states = hidden_states[inputs.logits_rows]
        if step.temperatures:
            token_ids = sample_vocab_parallel(self.model.compute_logits(hidden_states, False, num_logits),
                                              step.temperatures, step.uniforms, self.group,
                                              self.model.lm_head.vocab_start_idx, step.masked_rows,
                                              step.token_masks)
            if token_ids is not None:
                pipeline.send_to_first(torch.tensor(token_ids, dtype=torch.int64, device=self.device),
                                       step.virtual_engine)
            return None
        logits = self.model.compute_logits(hidden_states, num_rows=num_logits)
        if logits is not None:
            pipeline.send_to_first(logits.float(), step.virtual_engine)
        return None

    def sampled_by_last_stage(self, step: StepMessage, sampling: list[SamplingRecord]) -> SamplerOutput:
        """Rank 0: the tokens of a step it sent down the pipeline earlier (steps come back in the order they
        went): the last stage's own, or sampled here from the logits it sent."""
        num_logits = len(sampling)
        if not num_logits:
            return SamplerOutput([], [], [])
        if step.temperatures:
            token_ids = self.pipeline.recv_from_last((num_logits,), torch.int64, self.device, step.virtual_engine)
            return SamplerOutput(token_ids.tolist(), [None] * num_logits, [])
        logits = self.pipeline.recv_from_last((num_logits, self.hf_config.vocab_size), torch.float32, self.device,
                                              step.virtual_engine)
        return self.sampler(logits, sampling)
