"""One rank's execution: its model shard, its KV-cache shard, and turning a step message into a forward pass."""
import logging

import torch

from tpengine.attention import make_backend, resolve_backend_name
from tpengine.attention.kv_cache_dtype import is_fp8, kv_cache_torch_dtype
from tpengine.config import EngineConfig
from tpengine.distributed.messages import BlockTable, PrefillChunk, StepEnvelope, StepMessage, VocabParallelSampling
from tpengine.families import FAMILIES
from tpengine.distributed.parallel_state import PipelineGroup, TensorParallelGroup, building_model_for
from tpengine.hf_config import (kv_head_dim_of, load_hf_config, long_rope_threshold_of, max_positions_of,
                                 mrope_section_of)
from tpengine.kernels.cpu import sampling as cpu_sampling
from tpengine.layers.batch_invariant import building_batch_invariant
from tpengine.models.loader import load_and_prepack
from tpengine.models.registry import model_class
from tpengine.paging import blocks_for
from tpengine.pooling import read_pooling_config
from tpengine.platforms import platform_for
from tpengine.runner.cpu_threads import step_threads_for
from tpengine.runner.decode_path import EagerDecode, choose_decode_path
from tpengine.runner.drafter import Drafter
from tpengine.runner.image_embeddings import ImageEmbeddings
from tpengine.runner.mtp_drafter import MtpDrafter
from tpengine.runner.inputs import ForwardInputs, InputBuilder
from tpengine.runner.cuda_graphs import MAX_GRAPH_BATCH_SIZE
from tpengine.runner.kv_cache import KVCache, attention_layers_of, num_kvcache_blocks
from tpengine.runner.lora_adapters import LoRAAdapters
from tpengine.runner.pooler import Pooler
from tpengine.runner.prompt_logprobs import compute_prompt_logprobs
from tpengine.runner.sampler import Sampler, SamplerOutput, sample_vocab_parallel
from tpengine.runner.warmup import warm_up
from tpengine.sampling_params import SamplingRecord

logger = logging.getLogger("tpengine")


class ModelRunner:
    """Set up once (the model loaded, a warm-up, the KV cache sized and allocated, the decode path chosen), then one
    forward per step message (execute)."""

    def __init__(self, config: EngineConfig, group: TensorParallelGroup, device: torch.device,
                 sampler: Sampler | None = None, pipeline: PipelineGroup | None = None):
        self.config = config
        self.sampler = sampler  # rank 0's: the warm-up measures its memory too
        self.group = group
        self.pipeline = pipeline = pipeline or PipelineGroup(tp_size=group.size, tp_rank=group.rank)
        self.stage = pipeline.stage
        self.rank = pipeline.rank  # global: stage * tp + rank in the stage
        self.block_size = config.kvcache_block_size
        self.hf_config = hf_config = load_hf_config(config.model, config.hf_overrides)
        self.device = device
        self.platform = platform_for(device)
        self.platform.set_up_rank(device, config.world_size)  # every stage's ranks share the host
        self.max_num_batched_tokens = config.max_num_batched_tokens or self.platform.DEFAULT_MAX_NUM_BATCHED_TOKENS
        self.dtype = self.platform.resolve_dtype(config.dtype, hf_config, log=self.rank == 0)
        self.weight_dtype = self.platform.linear_weight_dtype(config.dtype)  # None: the linears' weights are in dtype
        self.max_model_len = config.max_model_len  # the engine already bounded it by the model's positions
        self.max_num_blocks_per_seq = blocks_for(self.max_model_len, self.block_size)
        # the cache's element: 1 byte for FP8, so the same memory holds 2x the tokens of a half-precision cache
        self.kv_cache_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype)
        self.backend_name = self._attention_backend_name()
        self.attention_backend = make_backend(self.backend_name, config.batch_invariant)
        if FAMILIES[hf_config.model_type].bidirectional_images and not self.attention_backend.reads_key_ends:
            raise ValueError(f"{hf_config.architectures[0]}'s image tokens attend to each other both ways, which "
                             f"attention backend {self.attention_backend.name!r} cannot compute; use "
                             "attention_backend='triton' or 'torch' (and batch_invariant=False)")
        self.model = self.load(config.model, hf_config, self.attention_backend)
        self.lora = self._lora_adapters()
        # an image model's image embeddings, made by its vision tower on this rank's shard
        self.image_embeddings = ImageEmbeddings(self.model, device, self.dtype) \
            if hasattr(self.model, "encode_images") else None
        # embedding requests' vectors are made on rank 0 (each tensor-parallel rank holds whole hidden states)
        self.pooler = Pooler(read_pooling_config(config.model, hf_config), self.model.classify) \
            if self.rank == 0 else None
        self.attention_layers = attention_layers_of(self.model)
        if self.rank == 0 and is_fp8(self.kv_cache_dtype):
            self._log_fp8_kv_scales()
        self.drafter = self._load_drafter()
        layers = [self.attention_layers, *([] if self.drafter is None else [self.drafter.attention_layers])]
        self.kv_cache = KVCache(layers, self.block_size, self.kv_cache_dtype, device)  # the drafter's: same blocks
        # CUDA: what the largest prefill and one step's sampling need beyond the weights, kept free
        # when the cache is sized
        self.activation_peak_bytes = self._warm_up() if device.type == "cuda" else 0
        self.num_kvcache_blocks = num_kvcache_blocks(config, device, self.kv_cache.block_bytes,
                                                     self.activation_peak_bytes, self.max_num_blocks_per_seq,
                                                     self._all_ranks_min)
        self.kv_cache.allocate(self.num_kvcache_blocks)
        self.inputs = self.input_builder()
        # CPU ranks sample a plain step over their own vocabulary slices, with no gather of the logits
        # (rank 0 decides per step: StepEnvelope.vocab_parallel), when every rank has the kernel
        # (a pipeline's last stage samples them at any tp: only the tokens go back to rank 0, not the logits)
        self.samples_vocab_parallel = (device.type == "cpu" and (group.size > 1 or pipeline.size > 1)
                                       and self._all_ranks_min(int(cpu_sampling.available())) == 1)
        self.decode_path = choose_decode_path(self)  # CUDA graphs, CPU replays or eager: decode_path.py
        # a CPU rank alone runs its small steps on one thread, from the limits warm-up measures (cpu_threads.py)
        self.step_threads = step_threads_for(device, group.size * self.pipeline.size, config.batch_invariant)
        if config.warm_up:  # what the first requests would pay on their path, paid now: runner/warmup.py
            warm_up(self)

    def _attention_backend_name(self) -> str:
        name = resolve_backend_name(self.config.attention_backend, self.device, self.block_size, self.dtype,
                                    self.kv_cache_dtype, self.config.batch_invariant, kv_head_dim_of(self.hf_config))
        if self.rank == 0:
            logger.info("attention backend: %s on %s (%s, KV cache %s)", name, self.device, self.dtype,
                        str(self.kv_cache_dtype).removeprefix("torch."))
        return name

    def _log_fp8_kv_scales(self) -> None:
        # vLLM warns alike: with scales of 1.0, K/V beyond e4m3's range are clamped
        unscaled = all(layer.k_scale.item() == layer.v_scale.item() == 1.0 for layer in self.attention_layers)
        logger.info("FP8 KV cache: %s", "every scale 1.0 (the checkpoint has none): K/V beyond +-448 are clamped"
                    if unscaled else "each layer's K and V scales from the checkpoint")

    def _load_drafter(self) -> Drafter | MtpDrafter | None:
        """Speculative decoding with a draft model, or the checkpoint's MTP layer: its shard on this rank, its KV
        cache in the same blocks."""
        spec = self.config.speculative_config
        if spec is None or spec.method not in ("draft_model", "mtp"):
            return None
        backend = make_backend(self.backend_name, self.config.batch_invariant)
        if spec.method == "mtp":
            from tpengine.models.deepseek import DeepseekMtp
            mtp = self.load(self.config.model, self.hf_config, backend, build=DeepseekMtp)
            mtp.share_with(self.model)
            return MtpDrafter(mtp, self.group)
        return Drafter(self.load(spec.model, load_hf_config(spec.model), backend), self.group)

    def _lora_adapters(self) -> LoRAAdapters | None:
        """The model's LoRA slots, with a row buffer for any step: its tokens (and the rest of an image a chunk
        runs to the end of, scheduler.keep_images_whole), a decode batch's verify queries and a decode bucket's
        padding."""
        config = self.config
        if not config.enable_lora:
            return None
        spec = config.speculative_config
        max_decode_rows = config.max_num_seqs * (1 + (0 if spec is None else spec.num_speculative_tokens))
        whole_image = self.hf_config.mm_tokens_per_image or 0 \
            if FAMILIES[self.hf_config.model_type].bidirectional_images else 0
        max_num_rows = (self.platform.row_bucket(self.max_num_batched_tokens + max_decode_rows + whole_image)
                        + MAX_GRAPH_BATCH_SIZE)
        return LoRAAdapters(self.model, config, self.dtype, self.device, max_num_rows)

    def input_builder(self) -> InputBuilder:
        """Step messages into this model's inputs (LongRoPE's rows rotated with the long set offset as its rotary
        cache wants them; each row's adapter slot with LoRA)."""
        family = FAMILIES[self.hf_config.model_type]
        return InputBuilder(self.block_size, self.device, long_rope_threshold_of(self.hf_config),
                            max_positions_of(self.hf_config), lora=self.lora is not None,
                            mrope=mrope_section_of(self.hf_config) is not None, images=family.images,
                            bidirectional_images=family.bidirectional_images)

    def load(self, path: str, hf_config, attention_backend, build=None) -> torch.nn.Module:
        """This rank's shard of a checkpoint (the model, a draft model, or build(hf_config, backend): the model's
        MTP layer): built for this rank's group and stage, then loaded, quantized and prepacked (models/loader.py)."""
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device), building_model_for(self.group, self.stage), \
                    building_batch_invariant(self.config.batch_invariant):
                model = (build or model_class(hf_config))(hf_config, attention_backend)
        finally:
            torch.set_default_dtype(default_dtype)
        for module in model.modules():  # latent attention's prefill (layers/latent_attention.py)
            if hasattr(module, "prefill_form"):
                module.prefill_form = self.config.mla_prefill
        load_and_prepack(model, path, hf_config, self.config, self.platform, self.device, self.weight_dtype,
                         log=self.rank == 0)
        return model

    def _all_ranks_min(self, value: int) -> int:
        """The smallest of every rank's value: over the stage's tensor-parallel group, then every stage."""
        return self.pipeline.all_reduce_min(self.group.all_reduce_min(value, self.device), self.device)

    # --- warm-up --------------------------------------------------------------------------------

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
        self.kv_cache.allocate(num_blocks)
        cache_bytes = num_blocks * self.kv_cache.block_bytes
        from_previous_stage = None if self.stage.is_first else torch.zeros(
            2, num_tokens, self.hf_config.hidden_size, dtype=self.dtype, device=self.device)
        hidden_states = self.model(inputs.input_ids, inputs.positions, inputs.meta, from_previous_stage)
        if not self.stage.is_last:  # stages measure their own peaks: no pipeline traffic at warm-up
            del hidden_states
            self.kv_cache.free()
            return cache_bytes
        rows = torch.arange(config.max_num_seqs, device=self.device) % num_tokens
        logits = self.model.compute_logits(hidden_states[rows])
        if self.sampler is not None and logits is not None:
            self.sampler.warm_up(logits)
        del hidden_states, logits
        self.kv_cache.free()
        return cache_bytes

    def close(self) -> None:
        """Release CUDA graphs (captured graphs hold collectives) and their pool, and the CPU's replays (they hold
        the KV cache), and let queued work finish, before the caller tears down the group."""
        self.decode_path = EagerDecode(self.model)
        if self.step_threads is not None:
            self.step_threads.restore()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    # --- execution ------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, envelope: StepEnvelope, sampling: list[SamplingRecord] | None = None) -> SamplerOutput | None:
        """Run one step in one forward. Rank 0 (given the sampled rows' records) gets their tokens: sampled
        from its gathered logits, or, when the envelope says so, by every rank over its own slice of the
        vocabulary. Other ranks get None."""
        step, vocab_parallel = envelope.step, envelope.vocab_parallel
        if self.step_threads is not None:
            self.step_threads.enter(step)
        if self.image_embeddings is not None:
            self.image_embeddings.forget(step.released)
        if step.block_copies:
            self.kv_cache.copy_blocks(step.block_copies)
        if step.lora_loads:
            self.lora.apply(step.lora_loads)
        if self.pipeline.size > 1:
            return self._execute_stage(step, vocab_parallel)
        if self.drafter is None:
            inputs, draft_token_ids = self.inputs.prepare(step), []
        else:  # between the tables' update and the inputs, the draft model proposes the verify rows' drafts
            step, inputs, draft_token_ids = self.drafter.prepare(step, self.inputs)
        if inputs.lora_slots is not None:
            self.lora.set_rows(inputs.lora_slots)
        # prompt chunks, with or without decode rows: eager; a decode step: the path chosen at start-up
        if inputs.image_rows:  # prompt rows that read an image: the vision tower's output replaces their embeddings
            hidden_states = self.model(inputs.input_ids, inputs.positions, inputs.meta,
                                       replaced_embeddings=self.image_embeddings.replaced_rows(inputs.image_rows))
        else:
            forward = self.model if inputs.meta.is_prefill else self.decode_path.run
            hidden_states = forward(inputs.input_ids, inputs.positions, inputs.meta)
        if self.drafter is not None:
            self.drafter.follow(step, hidden_states)
        scored = None
        if inputs.meta.is_prefill and any(chunk.prompt_logprobs for chunk in step.prefill):
            chunks = [chunk for chunk in step.prefill if not chunk.num_draft_tokens]  # the prompt rows' order
            scored = compute_prompt_logprobs(self.model, chunks, inputs.meta, hidden_states)
        output = self._sample(step, vocab_parallel, inputs, hidden_states, sampling, draft_token_ids)
        if scored:
            output = output._replace(prompt_logprobs=scored)
        pooler = self.pooler
        if pooler is not None and (pooler.partial or inputs.meta.is_prefill):
            pooler.forget(step.released)
            if inputs.meta.is_prefill and any(chunk.pooling for chunk in step.prefill):
                chunks = [chunk for chunk in step.prefill if not chunk.num_draft_tokens]  # the prompt rows' order
                output = output._replace(pooled=pooler.pool(chunks, inputs.meta, hidden_states))
        return output

    def _sample(self, step: StepMessage, vocab_parallel: VocabParallelSampling | None, inputs: ForwardInputs,
                hidden_states: torch.Tensor, sampling: list[SamplingRecord] | None,
                draft_token_ids: list[int]) -> SamplerOutput | None:
        """The one exit of a step that reaches the LM head (a pipeline's last stage too): every rank samples its own
        slice of the vocabulary when vocab_parallel is given, else rank 0 samples the logits gathered to it with
        the rows' records. Off rank 0's stage, the tokens or logits go to rank 0 (sampled_by_last_stage)."""
        num_logits = inputs.num_logits
        if not num_logits:  # only chunks that end short of their prompts: nothing to sample
            return None if sampling is None else SamplerOutput([], [], draft_token_ids)
        if inputs.logits_rows is not None:  # a prefill's: each sampled chunk's last row, and every decode row
            hidden_states = hidden_states[inputs.logits_rows]
        # outside the graphs: on tp > 1 the LM head gathers every rank's slice of the vocabulary to rank 0,
        # unless every rank samples its own slice
        if vocab_parallel is not None:
            token_ids = sample_vocab_parallel(self.model.compute_logits(hidden_states, False, num_logits),
                                              vocab_parallel, self.group, self.model.lm_head.vocab_start_idx)
            if token_ids is None:  # the group's other ranks
                return None
            if self.stage.is_first:
                return SamplerOutput(token_ids, [None] * num_logits, draft_token_ids)
            self.pipeline.send_to_first(torch.tensor(token_ids, dtype=torch.int64, device=self.device),
                                        step.virtual_engine)
            return None
        logits = self.model.compute_logits(hidden_states, num_rows=num_logits)
        if logits is None:
            return None
        if not self.stage.is_first:  # rank 0 samples them with its records
            self.pipeline.send_to_first(logits.float(), step.virtual_engine)
            return None
        output = self.sampler(logits, sampling)
        return output._replace(draft_token_ids=draft_token_ids) if draft_token_ids else output

    # --- pipeline parallelism -------------------------------------------------------------------

    def _execute_stage(self, step: StepMessage, vocab_parallel: VocabParallelSampling | None) -> None:
        """This stage's part of a step: the previous stage's hidden states in (unless first), its layers, and
        either the hidden states on to the next stage, or (the last) the step's tokens to rank 0: sampled here
        when vocab_parallel is given, else the logits, which rank 0 samples with its records. Sends do not
        wait, so a stage takes the next step while the next stage runs this one."""
        inputs = self.inputs.prepare(step)
        if inputs.lora_slots is not None:
            self.lora.set_rows(inputs.lora_slots)
        stage, pipeline = self.stage, self.pipeline
        from_previous_stage = None
        if not stage.is_first:
            shape = (2, inputs.input_ids.size(0), self.hf_config.hidden_size)
            from_previous_stage = pipeline.recv_from_previous_stage(shape, self.dtype, self.device, step.virtual_engine)
        hidden_states = self.model(inputs.input_ids, inputs.positions, inputs.meta, from_previous_stage)
        if not stage.is_last:
            pipeline.send_to_next_stage(hidden_states, step.virtual_engine)
            return None
        return self._sample(step, vocab_parallel, inputs, hidden_states, None, [])

    def sampled_by_last_stage(self, envelope: StepEnvelope, sampling: list[SamplingRecord]) -> SamplerOutput:
        """Rank 0: the tokens of a step it sent down the pipeline earlier (steps come back in the order they
        went): the last stage's own, or sampled here from the logits it sent."""
        num_logits = len(sampling)
        if not num_logits:
            return SamplerOutput([], [], [])
        step = envelope.step
        if envelope.vocab_parallel is not None:
            token_ids = self.pipeline.recv_from_last((num_logits,), torch.int64, self.device, step.virtual_engine)
            return SamplerOutput(token_ids.tolist(), [None] * num_logits, [])
        logits = self.pipeline.recv_from_last((num_logits, self.hf_config.vocab_size), torch.float32, self.device,
                                              step.virtual_engine)
        return self.sampler(logits, sampling)
