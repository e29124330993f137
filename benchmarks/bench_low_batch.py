"""Low-batch decode on the CPU: decode tok/s at small batches against the weight-read floor, in one run.

The model is the shape of the llama.cpp comparison in docs/benchmarks.md (history: docs/archive/benchmark-history.md): a random-weight Qwen3 with
vocab 8192, hidden 512, intermediate 1024, 6 layers, 8 heads / 4 KV heads of 64, untied LM head
(~18M params; float32 by default), written with transformers by tpengine.bench's write_model, or --model.

In one process, one engine (prefix caching off, so repeats compute everything):

- weight-read floor: the time to read every weight a decode step reads once (every parameter but the
  input embedding, of which a step reads one row per token), as a sum over each tensor in the run's dtype
  on the engine's threads. A sum reads each byte once and writes nothing, so it is the honest floor; a
  copy moves twice the bytes. Best of --repeat.
- decode: --batch-sizes sequences (default 1 4 16) with --context-len prompt tokens (default 208) decode
  together, greedy, ignore_eos; the median wall time of llm.step() over --steps decode steps after
  warm-up, as ms per step and output tok/s (batch / step time). Best of --repeat medians.
- llama.cpp's batched-bench shape (--batched-bench 1 16 48): llm.generate of `batch` prompts of 208
  random tokens, 56 decode steps each (max_tokens 57: the first token comes from the prefill, as
  llama-batched-bench -npp 208 -ntg 56 decodes 56 times after the prompt); total tok/s = batch x
  (208 + 56) / wall time, llama-batched-bench's S column. Best of --repeat.
- --breakdown: where one batch-1 decode step's time goes, layer kind by layer kind (see breakdown()).
- --ops: each fused CPU op (kernels/cpu/fused_ops.cpp) against the torch code it replaces (the CPU
  platform's fallback), at 1, 16 and 2048 tokens of the model's shape, best of 10 rounds on the engine's threads.
- baselines on the same checkpoint, the same batch sizes and context (benchmarks/decode_baselines.py says how each
  is timed): --transformers (generate, in this process), --llama-cpp BIN --gguf f32=PATH q8_0=PATH ...
  (llama-batched-bench), --vllm-python PATH (vLLM's offline LLM, in its venv). Every round each engine takes
  its turn, the order rotating round by round; the curve table gives each engine's median step and the range.
- --json PATH writes every round's figures (tools/plot_benchmarks.py draws decode tok/s by batch size for
  every engine, and tpengine's step against the weight-read floor).

    .venv/bin/python benchmarks/bench_low_batch.py                     # ~1 minute on 2 idle cores
    .venv/bin/python benchmarks/bench_low_batch.py --repeat 3 --breakdown
    .venv/bin/python benchmarks/bench_low_batch.py --batched-bench 1 16 48 --repeat 2
    .venv/bin/python benchmarks/bench_low_batch.py --ops --batch-sizes 1 --steps 5
    .venv/bin/python benchmarks/bench_low_batch.py --batch-sizes 1 4 16 64 --repeat 3 --transformers \
        --llama-cpp ~/.cache/llamacpp-anchor/llama.cpp/build/bin --gguf f32=model-f32.gguf q8_0=model-q8_0.gguf \
        --vllm-python ~/.cache/vllm-cpu-anchor/bin/python --model-dir DIR --json docs/bench-data/low_batch.json
    .venv/bin/python benchmarks/bench_low_batch.py --quick --breakdown --ops   # seconds: tpengine.bench's QUICK_MODEL
"""
import argparse
import collections
import os
import random
import shlex
import statistics
import sys
import tempfile
import time

import torch

import decode_baselines  # benchmarks/, this script's folder
from tpengine.bench.models import LOW_BATCH_MODEL, QUICK_MODEL, model_fields, num_params, write_model
from tpengine.bench.quick import parse_with_quick
from tpengine.bench.results import Record, add_json_flag, git_revision, load_average, machine_line
from tpengine.bench.timing import decode_step_ms
from tpengine.bench.workload import random_prompts

BATCHED_BENCH_OUTPUT = 56  # llama-batched-bench -ntg


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="existing checkpoint folder of a supported family (default: the random Qwen3 above)")
    p.add_argument("--model-dir", help="keep the random-weight model in this folder, and reuse it if it is there")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16], help="decode batches timed")
    p.add_argument("--context-len", type=int, default=208, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=40, help="decode steps timed per batch")
    p.add_argument("--warm-up-steps", type=int, default=5)
    p.add_argument("--batched-bench", type=int, nargs="*", default=[],
                   help="batches for llama-batched-bench's shape (prompt 208, 56 decode steps), e.g. 1 16 48")
    p.add_argument("--breakdown", action="store_true", help="also break one batch-1 decode step down by op kind")
    p.add_argument("--ops", action="store_true", help="also time each fused CPU op against its torch code")
    p.add_argument("--repeat", type=int, default=1, help="measure everything this many times, keep the best")
    p.add_argument("--transformers", action="store_true", help="baseline: transformers' generate, same checkpoint")
    p.add_argument("--llama-cpp", metavar="BIN", help="baseline: llama.cpp's bin folder (llama-batched-bench); needs --gguf")
    p.add_argument("--gguf", nargs="+", default=[], metavar="NAME=PATH",
                   help="GGUF files of the same checkpoint for --llama-cpp, e.g. f32=model-f32.gguf q4_0=model-q4_0.gguf")
    p.add_argument("--llama-cpp-threads", type=int, default=None, help="llama.cpp's -t (default: torch's threads)")
    p.add_argument("--vllm-python", metavar="PATH", help="baseline: the python of vLLM's CPU venv (offline LLM)")
    add_json_flag(p)
    args = parse_with_quick(p, argv, dict(batch_sizes=[1, 3], context_len=20, steps=3, warm_up_steps=1),
                            "tpengine.bench's QUICK_MODEL")
    if min(args.batch_sizes + args.batched_bench + [args.context_len, args.steps, args.repeat]) < 1:
        p.error("sizes and counts must be >= 1")
    if bool(args.llama_cpp) != bool(args.gguf):
        p.error("--llama-cpp and --gguf go together")
    args.gguf = decode_baselines.parse_gguf(args.gguf)
    return args


# --- the floor ------------------------------------------------------------------------------------

def step_weights(model_path: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """The checkpoint's tensors a decode step reads (all but the input embedding, unless the LM head shares
    it), in the run's dtype."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    tied = AutoConfig.from_pretrained(model_path).tie_word_embeddings
    tensors = []
    for name in sorted(os.listdir(model_path)):
        if name.endswith(".safetensors"):
            tensors += [t.to(dtype).contiguous() for key, t in load_file(os.path.join(model_path, name)).items()
                        if tied or "embed_tokens" not in key]
    return tensors


def weight_read_ms(tensors: list[torch.Tensor], repeats: int = 20) -> float:
    """Best ms of one pass that sums every tensor (each byte read once)."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for t in tensors:
            t.sum()
        best = min(best, time.perf_counter() - started)
    return best * 1e3


# --- decode ---------------------------------------------------------------------------------------

def batched_bench_seconds(llm, rng, batch: int, context_len: int) -> float:
    """Wall time of one generate in llama-batched-bench's shape: batch prompts, then 56 decode steps."""
    from tpengine import SamplingParams

    prompts = random_prompts(rng, batch, context_len, llm.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=BATCHED_BENCH_OUTPUT + 1, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    assert all(len(out.token_ids) == params.max_tokens for out in outputs), "tpengine wrote other lengths than asked"
    return elapsed


# --- breakdown ------------------------------------------------------------------------------------

class StageTimer:
    """Accumulates wall time per label over wrapped callables; restore() puts the originals back."""

    def __init__(self):
        self.seconds = collections.defaultdict(float)
        self._restore = []

    def wrap(self, owner, name: str, label: str) -> None:
        original = getattr(owner, name)
        seconds = self.seconds

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                seconds[label] += time.perf_counter() - started
        setattr(owner, name, timed)
        self._restore.append((owner, name, original, name in vars(owner)))

    def restore(self) -> None:
        for owner, name, original, own in reversed(self._restore):
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)


def breakdown(llm, rng, args) -> list[tuple[str, float]]:
    """ms per batch-1 decode step by kind: each layer kind's forward (all layers together), the executor's
    and the engine's own work, and the rest of the forward (Python between the ops). The timers add about
    a microsecond per wrapped call, counted in the stages they wrap."""
    from tpengine.engine.scheduler import Scheduler
    from tpengine.layers.activation import SiluAndMul
    from tpengine.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
    from tpengine.layers.layernorm import RMSNorm
    from tpengine.layers.linear import LinearBase
    from tpengine.layers.rotary_embedding import RotaryEmbedding
    from tpengine.runner.decode_path import EagerDecode

    executor, runner = llm.executor, llm.executor.runner
    model = runner.model
    timer = StageTimer()
    linears = {type(m) for m in model.modules() if isinstance(m, LinearBase)}
    for cls in linears:
        timer.wrap(cls, "forward", "linears (q/k/v, o, gate/up, down)")
    timer.wrap(ParallelLMHead, "forward", "LM head (linear)")
    timer.wrap(VocabParallelEmbedding, "forward", "embedding")
    timer.wrap(RMSNorm, "forward", "RMSNorm (+ residual add)")
    timer.wrap(RotaryEmbedding, "forward", "q/k norm + rotary")
    timer.wrap(SiluAndMul, "forward", "SiLU and mul")
    backend = runner.attention_backend
    timer.wrap(backend, "store_kvcache", "KV store")
    timer.wrap(backend, "decode", "decode attention")
    timer.wrap(model, "forward", "forward")
    timer.wrap(model, "compute_logits", "compute_logits")
    timer.wrap(runner.inputs, "prepare", "input preparation (runner.inputs.prepare)")
    timer.wrap(Scheduler, "_plan", "step message (Scheduler._plan)")
    timer.wrap(runner, "sampler", "sampler")
    timer.wrap(executor, "submit", "execute")  # one stage: a step runs whole in submit
    timer.wrap(Scheduler, "schedule", "scheduler: schedule")
    timer.wrap(Scheduler, "postprocess", "scheduler: postprocess")
    # the timers wrap the model's Python: the breakdown decodes eagerly, not through the CPU's replayed steps
    decode_path, runner.decode_path = runner.decode_path, EagerDecode(runner.model)
    try:
        total_ms, seconds = decode_step_ms_with(llm, rng, args, timer)
    finally:
        timer.restore()
        runner.decode_path = decode_path
    ms = {label: s * 1e3 / args.steps for label, s in seconds.items()}
    forward_parts = ["linears (q/k/v, o, gate/up, down)", "embedding", "RMSNorm (+ residual add)",
                     "q/k norm + rotary", "SiLU and mul", "KV store", "decode attention"]
    rows = [(label, ms.get(label, 0.0)) for label in forward_parts]
    rows.append(("rest of the forward (Python between the ops, views, splits)",
                 ms["forward"] - sum(ms.get(label, 0.0) for label in forward_parts)))
    rows.append(("LM head (linear)", ms.get("LM head (linear)", 0.0)))
    rows.append(("sampler", ms["sampler"]))
    rows.append(("input preparation (runner.inputs.prepare)", ms["input preparation (runner.inputs.prepare)"]))
    rows.append(("step message (Scheduler._plan)", ms["step message (Scheduler._plan)"]))
    inside = ["forward", "compute_logits", "sampler", "input preparation (runner.inputs.prepare)"]
    rows.append(("rest of execute (runner glue, inference mode)", ms["execute"] - sum(ms[label] for label in inside)))
    rows.append(("scheduler: schedule (its message included)", ms["scheduler: schedule"]))
    rows.append(("scheduler: postprocess", ms["scheduler: postprocess"]))
    rows.append(("rest of llm.step() (outputs, bookkeeping)",
                 total_ms - ms["execute"] - ms["scheduler: schedule"] - ms["scheduler: postprocess"]))
    rows.append(("**whole step (mean, timers on)**", total_ms))
    return rows


def decode_step_ms_with(llm, rng, args, timer: StageTimer) -> tuple[float, dict[str, float]]:
    """Mean ms of args.steps batch-1 decode steps, and the timer's seconds per label over those steps."""
    from tpengine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.warm_up_steps + args.steps + 2, ignore_eos=True)
    llm.add_request(random_prompts(rng, 1, args.context_len, llm.vocab_size)[0], params, stream=False)
    for _ in range(1 + args.warm_up_steps):  # the prefill, then warm-up
        llm.step()
    timer.seconds.clear()
    started = time.perf_counter()
    for _ in range(args.steps):
        llm.step()
    total = time.perf_counter() - started
    seconds = dict(timer.seconds)
    while llm.has_unfinished_requests():
        llm.step()
    return total * 1e3 / args.steps, seconds


# --- fused ops against their torch code ----------------------------------------------------------

def best_us(fn, repeats: int = 10, calls: int = 20) -> float:
    started = time.perf_counter()
    fn()
    calls = max(1, min(calls, int(1e-3 / max(time.perf_counter() - started, 1e-9))))  # about 1 ms a round
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - started) / calls)
    return best * 1e6


def op_rows(config, dtype: torch.dtype) -> list[tuple[str, int, float, float]]:
    """(op, tokens, torch code us, fused us) at the model's shape; each op gets fresh copies of its inputs,
    as the fused ones write in place."""
    from tpengine.kernels.cpu import fused_ops
    from tpengine.platforms.torch_ops import (add_rms_norm, apply_rotary_in_halves, rms_norm, silu_and_mul,
                                              store_kvcache_masked)

    hidden, head_dim = config.hidden_size, config.head_dim
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    eps = config.rms_norm_eps
    weight, head_weight = torch.randn(hidden, dtype=dtype), torch.randn(head_dim, dtype=dtype)
    cache = torch.randn(4096, head_dim)
    rows = []
    for tokens in (1, 16, 2048):
        x, residual = torch.randn(tokens, hidden, dtype=dtype), torch.randn(tokens, hidden, dtype=dtype)
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
        q, k, v = (t.view(tokens, -1, head_dim) for t in qkv.split([heads * head_dim, kv_heads * head_dim,
                                                                     kv_heads * head_dim], dim=-1))
        positions = torch.arange(tokens) + 100
        gate_up = torch.randn(tokens, 2 * config.intermediate_size, dtype=dtype)
        k_cache, v_cache = torch.zeros(2, (tokens + 255) // 256 + 1, 256, kv_heads, head_dim, dtype=dtype)
        slots = torch.randperm(k_cache.size(0) * 256)[:tokens]
        rows += [
            ("residual add + RMSNorm", tokens, best_us(lambda: add_rms_norm(x, residual, weight, eps)),
             best_us(lambda: fused_ops.add_rms_norm_(x.clone(), residual.clone(), weight, eps))
             - best_us(lambda: (x.clone(), residual.clone()))),
            ("RMSNorm", tokens, best_us(lambda: rms_norm(x, weight, eps)),
             best_us(lambda: fused_ops.rms_norm(x, weight, eps))),
            ("q/k norm + rotary", tokens,
             best_us(lambda: apply_rotary_in_halves(positions, rms_norm(q, head_weight, eps), rms_norm(k, head_weight, eps),
                                                  cache)),
             best_us(lambda: fused_ops.qk_norm_rotary_(q, k, head_weight, head_weight, eps, positions, cache))),
            ("SiLU and mul", tokens, best_us(lambda: silu_and_mul(gate_up)), best_us(lambda: fused_ops.silu_and_mul(gate_up))),
            ("KV store", tokens, best_us(lambda: store_kvcache_masked(k, v, k_cache, v_cache, slots)),
             best_us(lambda: fused_ops.store_kvcache(k, v, k_cache, v_cache, slots))),
        ]
    return rows


# --- report ---------------------------------------------------------------------------------------

def start_baselines(args, model_path: str) -> list:
    """The baselines asked for, each ready to time (vLLM's start-up and warm-up happen here)."""
    steps = args.steps
    baselines = []
    if args.transformers:
        baselines.append(decode_baselines.TransformersDecode(model_path, args.dtype, args.context_len, steps))
    for name, gguf in args.gguf:
        baselines.append(decode_baselines.LlamaCppDecode(args.llama_cpp, name, gguf, args.context_len, steps,
                                                         args.llama_cpp_threads or torch.get_num_threads()))
    if args.vllm_python:
        baselines.append(decode_baselines.VllmDecode(args.vllm_python, model_path, args.dtype, args.context_len,
                                                     steps, args.batch_sizes))
    return baselines


def main(argv=None) -> None:
    args = parse_args(argv)
    from tpengine import LLM
    from transformers import AutoConfig

    command = " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + list(argv or sys.argv[1:]))
    record = Record("bench_low_batch", argv, machine_line("cpu", torch.get_num_threads()))
    load_before = load_average()
    ours_label = f"tpengine ({args.dtype})"
    with tempfile.TemporaryDirectory(prefix="tpengine-low-batch-") as tmp:
        model_path = args.model or write_model("cpu", args.model_dir or os.path.join(tmp, "model"),
                                               QUICK_MODEL if args.quick else LOW_BATCH_MODEL)
        config = AutoConfig.from_pretrained(model_path)
        dtype = getattr(torch, args.dtype)
        weights = step_weights(model_path, dtype)
        weight_bytes = sum(t.numel() * t.element_size() for t in weights)
        max_batch = max(args.batch_sizes + args.batched_bench)
        llm = LLM(model_path, dtype=args.dtype, max_num_seqs=max_batch, enable_prefix_caching=False,
                  max_model_len=args.context_len + max(args.warm_up_steps + args.steps, BATCHED_BENCH_OUTPUT) + 8)
        baselines = []
        try:
            baselines = start_baselines(args, model_path)
            rng = random.Random(0)
            floor_ms, decode_ms, bench_s = [], collections.defaultdict(list), collections.defaultdict(list)
            curves = {name: collections.defaultdict(list) for name in [ours_label] + [b.label for b in baselines]}
            turns = [None] + baselines  # None: tpengine's turn
            for round_ in range(args.repeat):
                for turn in turns[round_ % len(turns):] + turns[:round_ % len(turns)]:  # the order rotates
                    if turn is None:
                        floor_ms.append(weight_read_ms(weights))
                        for batch in args.batch_sizes:
                            decode_ms[batch].append(decode_step_ms(llm, rng, batch, args.context_len, args.steps, args.warm_up_steps))
                            curves[ours_label][batch].append(decode_ms[batch][-1])
                        for batch in args.batched_bench:
                            bench_s[batch].append(batched_bench_seconds(llm, rng, batch, args.context_len))
                    else:
                        for batch, ms in turn.step_ms(args.batch_sizes).items():
                            curves[turn.label][batch].append(ms)
                print(f"[round {round_ + 1}/{args.repeat}] load {load_average()}", file=sys.stderr)
            rows = breakdown(llm, rng, args) if args.breakdown else []
            ops = op_rows(config, dtype) if args.ops else []
        finally:
            for baseline in baselines:
                baseline.close()
            llm.shutdown()
    floor = min(floor_ms)
    print(f"command: `{command}`")
    print(f"machine: {machine_line('cpu', torch.get_num_threads())}")
    print(f"load average (1/5/15 min): {load_before} before, {load_average()} after; tpengine revision {git_revision()}")
    print(f"model: hidden {config.hidden_size}, {config.num_hidden_layers} layers, {config.num_attention_heads}/"
          f"{config.num_key_value_heads} heads x {config.head_dim}, intermediate {config.intermediate_size}, vocab "
          f"{config.vocab_size} (~{num_params(config) / 1e6:,.0f}M params), {args.dtype}; best of {args.repeat}")
    print()
    print("| measured in one run | ms | tok/s | / weight-read floor |")
    print("|---|---:|---:|---:|")
    print(f"| weight-read floor: sum over the {weight_bytes / 1e6:,.1f} MB a decode step reads "
          f"({weight_bytes / floor / 1e6:,.1f} GB/s) | {floor:.3f} | | 1.00 |")
    for batch in args.batch_sizes:
        ms = min(decode_ms[batch])
        print(f"| decode step, batch {batch}, context {args.context_len} | {ms:.3f} | {batch / ms * 1e3:,.0f} "
              f"| {ms / floor:.2f} |")
    for batch in args.batched_bench:
        seconds = min(bench_s[batch])
        total = batch * (args.context_len + BATCHED_BENCH_OUTPUT)
        print(f"| batched-bench shape, batch {batch} (prompt {args.context_len}, {BATCHED_BENCH_OUTPUT} decode "
              f"steps): total tok/s | {seconds * 1e3:,.0f} | {total / seconds:,.0f} | |")
    if baselines:
        print()
        print(f"Decode by batch size, context {args.context_len}: tok/s of the median step over {args.repeat} "
              f"round(s) (range), and ours over each baseline:")
        print()
        print("| engine | " + " | ".join(f"batch {batch}" for batch in args.batch_sizes) + " |")
        print("|---|" + "---:|" * len(args.batch_sizes))
        for label, by_batch in curves.items():
            cells = []
            for batch in args.batch_sizes:
                rates = sorted(batch / ms * 1e3 for ms in by_batch[batch])
                cell = f"{batch / statistics.median(by_batch[batch]) * 1e3:,.0f}"
                cells.append(cell + (f" ({rates[0]:,.0f}-{rates[-1]:,.0f})" if len(rates) > 1 else ""))
            print(f"| {label} | " + " | ".join(cells) + " |")
        for label in list(curves)[1:]:
            ratios = [statistics.median(curves[label][b]) / statistics.median(curves[ours_label][b])
                      for b in args.batch_sizes]
            print(f"| {ours_label} / {label} | " + " | ".join(f"{r:.2f}x" for r in ratios) + " |")
    record.write(args.json, model=dict(model_fields(config), path=args.model or "random-weight Qwen3 (LOW_BATCH_MODEL)"),
                 dtype=args.dtype, context_len=args.context_len, decode_steps=args.steps, rounds=args.repeat,
                 weight_bytes=weight_bytes, floor_ms=floor_ms,
                 kv_bytes_per_token=2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
                 * dtype.itemsize,
                 series=[dict(label=label, engine=label.split(" ")[0], batch=batch, step_ms=ms)
                         for label, by_batch in curves.items() for batch, ms in by_batch.items()],
                 batched_bench=[dict(batch=batch, seconds=s, total_tokens=batch * (args.context_len + BATCHED_BENCH_OUTPUT))
                                for batch, s in bench_s.items()],
                 breakdown=[dict(part=label, ms=ms) for label, ms in rows])
    if rows:
        print()
        print(f"Batch-1 decode step by op kind (context {args.context_len}, mean of {args.steps} steps):")
        print()
        print("| part of the step | ms |")
        print("|---|---:|")
        for label, ms in rows:
            print(f"| {label} | {ms:.3f} |")
    if ops:
        print()
        print("Fused CPU ops against the torch code they replace (us per call, best of 10 rounds; the in-place add +")
        print("RMSNorm is timed on fresh copies, the copies' time taken off):")
        print()
        print("| op | tokens | torch code | fused | speed-up |")
        print("|---|---:|---:|---:|---:|")
        for name, tokens, torch_us, fused_us in ops:
            print(f"| {name} | {tokens} | {torch_us:,.1f} | {fused_us:,.1f} | {torch_us / fused_us:.1f}x |")


if __name__ == "__main__":
    main()
