"""What the first requests would otherwise pay on their path, paid before the engine takes any (EngineConfig.warm_up):
each decode batch size's first step (a CPU row bucket's replay is recorded then, cpu_replay.py), each C++ kernel's
load and build, the sampler's first draws, the first
prompt steps. A server that answered /health before this sent its first requests into seconds of stalls.

Every rank runs the same dummy steps through its runner's own execute, so their collectives line up, over a
scratch InputBuilder whose tables are dropped afterwards. Their K/V goes to cache blocks no request holds yet (none
has run), and rank 0 samples them greedily: the sampler's generator, which seeded runs depend on, is untouched.
"""
import logging
import time

import torch

from tpengine.distributed.messages import BlockTable, PrefillChunk, StepEnvelope, StepMessage, int_column
from tpengine.paging import blocks_for
from tpengine.runner.cpu_threads import CALIBRATION_CONTEXT, STREAMING_SLOWDOWN
from tpengine.runner.cuda_graphs import graph_batch_sizes
from tpengine.sampling_params import SamplingParams, SamplingRecord

logger = logging.getLogger("tpengine")

# Prompt steps of these many tokens (and of the largest step the limits allow); one prompt step also carries a
# decode row, as the mixed scheduler's steps do.
PROMPT_SIZES = (16, 256)
_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


def decode_sizes(device: torch.device, row_bucket, max_num_seqs: int) -> list[int]:
    """The decode batch sizes whose first step costs more than the next: on the CPU every row bucket up to
    max_num_seqs (one replay recorded each); on CUDA each graph's size (the LM head and sampler run at it)."""
    if device.type == "cuda":
        return graph_batch_sizes(max_num_seqs)
    return sorted({row_bucket(num_rows) for num_rows in range(1, max_num_seqs + 1)})


def prompt_sizes(largest: int) -> list[int]:
    """Prompt steps' token counts: PROMPT_SIZES, and the largest one step may hold."""
    return sorted({min(size, largest) for size in (*PROMPT_SIZES, largest)})


class _DummySteps:
    """Step messages of dummy sequences, each with fresh blocks (round the cache: their contents do not matter)."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int):
        self.num_blocks, self.block_size, self.max_model_len = num_blocks, block_size, max_model_len
        self.next_seq_id = self.next_block = 0

    def _table(self, num_tokens: int) -> BlockTable:
        blocks = [(self.next_block + i) % self.num_blocks for i in range(blocks_for(num_tokens, self.block_size))]
        self.next_block = (self.next_block + len(blocks)) % self.num_blocks
        self.next_seq_id += 1
        return BlockTable(self.next_seq_id - 1, blocks)

    def step(self, num_decode_rows: int, num_prompt_tokens: int = 0, sampled: bool = True,
             context_len: int = 2) -> tuple[StepMessage, int]:
        """num_decode_rows decode rows (each its sequence's token context_len) and num_prompt_tokens of prompts in
        chunks of at most max_model_len, sampled or not; and how many rows it samples."""
        tables = [self._table(context_len) for _ in range(num_decode_rows)]
        chunks = []
        for start in range(0, num_prompt_tokens, self.max_model_len):
            length = min(self.max_model_len, num_prompt_tokens - start)
            tables.append(self._table(length))
            chunks.append(PrefillChunk(tables[-1].seq_id, [0] * length, 0, sampled))
        decode_ids = [table.seq_id for table in tables[:num_decode_rows]]
        step = StepMessage(decode_seq_ids=int_column(decode_ids), decode_tokens=int_column([0] * num_decode_rows),
                           decode_context_lens=int_column([context_len] * num_decode_rows), prefill=chunks,
                           new_tables=tables)
        return step, num_decode_rows + (len(chunks) if sampled else 0)


@torch.inference_mode()
def warm_up(runner) -> None:
    """Run the dummy steps on this rank of a ModelRunner whose KV cache, inputs and decode path are ready."""
    config, log = runner.config, runner.rank == 0
    if runner.pipeline.size > 1:  # a stage's step waits on the others' sends: not a step a rank can run alone
        if log:
            logger.info("warm-up skipped: pipeline stages run their first steps as requests come")
        return
    decode = decode_sizes(runner.device, runner.inputs.row_bucket, config.max_num_seqs)
    prompts = prompt_sizes(min(runner.max_num_batched_tokens, config.max_num_seqs * config.max_model_len,
                               runner.num_kvcache_blocks * runner.block_size))
    if log:
        what = "CPU decode replays recorded" if runner.device.type == "cpu" and runner.decode_path.replays else \
            "decode steps"
        logger.info("warming up: %s for %d batch sizes (%d..%d rows), prompt steps of %s tokens, the sampler%s",
                    what, len(decode), decode[0], decode[-1], ", ".join(map(str, prompts)),
                    "; the KV cache's pages mapped" if runner.device.type == "cpu" else "")
    started = time.monotonic()
    runner.kv_cache.map_pages()
    steps = _DummySteps(runner.num_kvcache_blocks, runner.block_size, config.max_model_len)
    real_inputs, runner.inputs = runner.inputs, runner.input_builder()  # the dummy tables stay in the scratch one
    try:
        samples = runner.model.lm_head is not None  # a classification checkpoint never decodes or samples
        for num_rows in decode if samples else ():
            _run(runner, *steps.step(num_rows))
        for num_tokens in prompts:
            _run(runner, *steps.step(0, num_tokens, sampled=samples))
        if samples:
            _run(runner, *steps.step(1, prompts[0]))  # decode rows and a prompt in one step: the mixed path
        if runner.sampler is not None and samples:  # every option's first draw (the generator is restored after)
            runner.sampler.warm_up(torch.zeros(1, runner.hf_config.vocab_size, device=runner.device))
        if runner.step_threads is not None and samples:
            _calibrate_threads(runner, steps, decode, prompts[-1])
    finally:
        runner.inputs = real_inputs
        if runner.drafter is not None:  # nothing of the dummy sequences may reach a real one of the same id
            runner.drafter.forget_all()
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    if log:
        logger.info("warmed up in %.1f s", time.monotonic() - started)


def _calibrate_threads(runner, steps: _DummySteps, decode: list[int], max_prompt_tokens: int) -> None:
    """Which steps run on one thread (cpu_threads.py): decode rows at a prompt's context, prompts alone."""
    context_len = min(CALIBRATION_CONTEXT, runner.max_model_len)
    threads = runner.step_threads
    threads.calibrate(lambda num_rows: _run(runner, *steps.step(num_rows, context_len=context_len)),
                      lambda num_tokens: _run(runner, *steps.step(0, num_tokens)), decode, context_len,
                      max_prompt_tokens)
    if runner.rank != 0:
        return
    if threads.max_one_thread_rows or threads.max_one_thread_tokens or threads.max_streaming_tokens:
        logger.info("one thread of %d runs decode steps of up to %d rows and prompt steps of up to %d tokens "
                    "(measured faster), %d with decode rows (at most %.1fx slower: a core left to the HTTP side)",
                    threads.num_threads, threads.max_one_thread_rows, threads.max_one_thread_tokens,
                    threads.max_streaming_tokens, STREAMING_SLOWDOWN)
    else:
        logger.info("every step runs on all %d threads (one was not faster at any size measured)",
                    threads.num_threads)


def _run(runner, step: StepMessage, num_sampled: int) -> None:
    # rank 0 samples the rows (greedily); the other ranks only take part in the LM head's gather
    sampling = None if runner.sampler is None else [SamplingRecord(_GREEDY, frozenset(), [0, 0], 1)] * num_sampled
    runner.execute(StepEnvelope(step), sampling)
