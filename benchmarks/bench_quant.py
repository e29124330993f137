"""Quantized weights on the CPU: float32, bfloat16, int8 and int4 side by side, with llama.cpp's Q8_0 and Q4_0 of
the same weights as the anchor, in one run. With --device cuda: bfloat16, fp8 (sm_89+), int8 and int4 on the GPU,
checked against the GPU issue's aims (FP8's decode step at most 0.6x bfloat16's, its throughput 1.3x).

Models (random weights, written once and cached in ~/.cache/tpengine-bench/, or --model):
- qwen3-0.6b: Qwen3-0.6B's shape (tpengine.bench's QWEN3_0_6B: vocab 151,936, 28 layers, hidden 1024, intermediate
  3072, 16 heads / 8 KV heads of 128, tied head; ~596M parameters).
- small: bench_low_batch.py's model (vocab 8192, hidden 512, 6 layers, untied head; ~18M parameters).

Formats: LLM(model, dtype=...) for float32 and bfloat16; LLM(model, dtype=--quantized-dtype, quantization="int8" |
"int4", quantization_group_size=--group-size) for int8 (one scale per output channel) and int4 (groups of 128),
the LM head (and the tied embedding) quantized too. A half dtype this CPU has no instructions for runs as float32
(the "runs in" column says so): without AVX512-BF16, "bfloat16" is float32 activations on bfloat16 linear weights
(AVX2 CPUs) or float32 weights (others).

Each round loads every format in turn into a fresh engine (one at a time, so a 0.6B model's four copies never
share the memory) and measures, in this order:
- resident weight bytes: the model's parameters plus every packed form a layer holds after prepack (packed_weight,
  packed_rows, packed_experts: tensors, or NamedTuples of them), each tensor once; the process's RSS growth over
  the load is printed beside it as a cross-check (the KV cache is allocated untouched, so it adds nothing).
- decode at batch 1, 4 and 16 (--batch-sizes): tpengine/bench/timing.py's decode_step_ms, `batch` random prompts of
  --context-len tokens, greedy, ignore_eos, the median llm.step() over --steps decode steps after --warm-up-steps;
  tok/s = batch / step time.
- throughput: llm.generate of --throughput-seqs random prompts of --short-prompt-len tokens writing
  --throughput-output tokens each; output tok/s = seqs x output tokens / wall time (the prefill included; short
  prompts, so decode at a large batch dominates it).
- top-1 agreement (first round only): greedy tokens of --agreement-prompts random prompts of --short-prompt-len
  tokens against float32's,
  as the fraction of positions before each prompt's first divergence and the fraction of positions equal.
Rounds alternate the formats (--repeat), and each figure keeps its best round. --eager-too adds each format
again with enforce_eager=True, in the same rounds: on a CPU, decode without the replayed steps (cpu_replay.py).

--llamacpp BIN (../shared/bench/llamacpp/README.md builds it) adds llama.cpp's f16, Q8_0 and Q4_0 of the same
checkpoint (convert_novocab.py, then llama-quantize for Q4_0 with its default tensor mix; cached beside the
model), measured the same way in every round after tpengine's formats, each keeping its best round too:
- decode: `llama-batched-bench -npp CONTEXT -ntg WARM_UP+STEPS -npl 1,4,16 -pps -t THREADS -fa off -no-kvu`;
  tok/s is its S_TG column. -pps prefills the prompt once and copies its KV into each sequence, so every
  decode step reads as much KV as ours; llama-bench's tg128 would decode from an empty context instead.
- throughput: `llama-batched-bench -npp SHORT_PROMPT -ntg OUTPUT -npl SEQS` (every prompt prefilled, as ours);
  output tok/s = SEQS x OUTPUT / its T column.
-nr (no repacking) as the README says: the AMX repack path crashes on these VMs.

    .venv/bin/python benchmarks/bench_quant.py --llamacpp ~/.cache/llamacpp-anchor/llama.cpp/build/bin
    .venv/bin/python benchmarks/bench_quant.py --models small --repeat 2 --json /tmp/quant.json
    .venv/bin/python benchmarks/bench_quant.py --quick        # seconds: tpengine.bench's QUICK_MODEL, no llama.cpp
    python benchmarks/bench_quant.py --device cuda --model DIR --batch-sizes 1 16 64   # tools/gpu_check.sh's part 5
"""
import argparse
import gc
import json
import os
import random
import shlex
import subprocess
import sys
import time

import torch

from decode_baselines import LlamaCppDecode, parse_batched_bench  # benchmarks/, this script's folder
from tpengine.bench.models import (CACHE, CACHED_MODEL_FOLDERS, LOW_BATCH_MODEL, QUICK_MODEL, QWEN3_0_6B, num_params,
                                   write_model)
from tpengine.bench.quick import parse_with_quick
from tpengine.bench.results import Record, add_json_flag, load_average, machine_line
from tpengine.bench.timing import decode_step_ms
from tpengine.bench.workload import random_prompts

MODELS = {"qwen3-0.6b": QWEN3_0_6B, "small": LOW_BATCH_MODEL}
FORMATS = ("float32", "bfloat16", "fp8", "int8", "int4")
DEFAULT_FORMATS = {"cpu": ("float32", "bfloat16", "int8", "int4"),  # no FP8 matmul on a CPU
                   "cuda": ("bfloat16", "fp8", "int8", "int4")}
BASELINE = "bfloat16"  # the aims are ratios to it
CONVERTER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "bench",
                         "llamacpp", "convert_novocab.py")
LLAMA_FORMATS = (("f16", "float32"), ("Q8_0", "int8"), ("Q4_0", "int4"))  # llama.cpp's, and ours it is set against
CONVERTER_TYPES = ("f32", "f16", "bf16", "q8_0")  # what convert_novocab.py writes itself


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=tuple(MODELS), default=list(MODELS))
    p.add_argument("--model", help="a float checkpoint folder instead of --models' random ones")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: weights on the GPU (bfloat16, fp8 where sm_89+, int8, int4); memory growth is "
                        "torch.cuda's allocated bytes, not RSS")
    p.add_argument("--formats", nargs="+", choices=FORMATS, help="default: every format the device runs")
    p.add_argument("--quantized-dtype", choices=("float32", "bfloat16"), default="bfloat16",
                   help="dtype of the int8/int4 engines (activations, norms, KV cache)")
    p.add_argument("--group-size", type=int, default=128, help="int4's quantization_group_size")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16], help="decode batches timed")
    p.add_argument("--context-len", type=int, default=208, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=24, help="decode steps timed per batch")
    p.add_argument("--warm-up-steps", type=int, default=4)
    p.add_argument("--throughput-seqs", type=int, default=64, help="sequences of the throughput run (0: none)")
    p.add_argument("--throughput-output", type=int, default=32, help="tokens each throughput sequence writes")
    p.add_argument("--short-prompt-len", type=int, default=32,
                   help="prompt tokens of the throughput and agreement sequences (their prefill stays cheap)")
    p.add_argument("--agreement-prompts", type=int, default=4, help="prompts of the top-1 agreement (0: none)")
    p.add_argument("--agreement-tokens", type=int, default=32, help="greedy tokens per agreement prompt")
    p.add_argument("--repeat", type=int, default=1, help="rounds over the formats, alternating; best kept")
    p.add_argument("--eager-too", action="store_true",
                   help="each format also with enforce_eager=True (\"FORMAT eager\"), in the same rounds: on a CPU, "
                        "decode without the replayed steps")
    p.add_argument("--llamacpp", metavar="BIN", help="llama.cpp's build/bin: also measure its f16, Q8_0, Q4_0")
    p.add_argument("--llamacpp-formats", nargs="+", choices=[name for name, _ in LLAMA_FORMATS],
                   default=[name for name, _ in LLAMA_FORMATS])
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="llama.cpp's -t")
    add_json_flag(p)
    args = parse_with_quick(p, argv, dict(models=["small"], group_size=32, batch_sizes=[1, 2], context_len=16,
                                          short_prompt_len=8,
                                          steps=2, warm_up_steps=1, throughput_seqs=3, throughput_output=4,
                                          agreement_prompts=2, agreement_tokens=4),
                            "tpengine.bench's QUICK_MODEL instead of --models'; no llama.cpp")
    if min(args.batch_sizes + [args.context_len, args.short_prompt_len, args.steps, args.repeat, args.group_size]) < 1 \
            or min(args.throughput_seqs, args.agreement_prompts, args.warm_up_steps) < 0:
        p.error("sizes and counts must be >= 1 (--throughput-seqs, --agreement-prompts, --warm-up-steps >= 0)")
    if args.quick and args.llamacpp:
        p.error("--quick runs no llama.cpp")
    args.formats = args.formats or list(DEFAULT_FORMATS[args.device])
    if args.device == "cpu" and "fp8" in args.formats:
        p.error("fp8 needs a GPU with FP8 matmuls (sm_89+): a CPU has none")
    return args


# --- tpengine -------------------------------------------------------------------------------------

def engine_kwargs(fmt: str, args) -> dict:
    if fmt == "fp8":  # e4m3 per output channel, activations per token; the LM head stays bfloat16
        return dict(dtype="bfloat16", quantization=fmt)
    if fmt == "int4":
        return dict(dtype=args.quantized_dtype, quantization=fmt, quantization_group_size=args.group_size)
    if fmt == "int8":  # one scale per output channel: no group size
        return dict(dtype=args.quantized_dtype, quantization=fmt)
    return dict(dtype=fmt)


def memory_bytes(device: str) -> int:
    """This process's resident bytes (CPU), or the bytes torch holds on the GPU."""
    if device == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def weight_tensors(model: torch.nn.Module) -> dict[int, torch.Tensor]:
    """The parameters and every packed form (attributes named packed_*) the model's layers hold, each tensor once
    (a tied head's packed weight may be its embedding's), by id."""
    tensors = {}

    def add(value) -> None:
        if isinstance(value, torch.Tensor):
            tensors[id(value)] = value
        elif isinstance(value, (tuple, list)):  # NamedTuples of tensors, lists of packed experts
            for item in value:
                add(item)

    for module in model.modules():
        for param in module.parameters(recurse=False):
            add(param)
        for name, value in vars(module).items():
            if name.startswith("packed"):
                add(value)
    return tensors


def resident_weight_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in weight_tensors(model).values())


def generate_seconds(llm, prompts: list[list[int]], output_len: int) -> float:
    from tpengine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    assert all(len(out.token_ids) == output_len for out in outputs), "tpengine wrote other lengths than asked"
    return elapsed


def greedy_tokens(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from tpengine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def measure_format(model_path: str, fmt: str, args, agreement_prompts, enforce_eager: bool = False) -> dict:
    """One fresh engine of fmt: its resident weights, decode step ms per batch, throughput seconds, and (when
    agreement_prompts) its greedy tokens on them."""
    from tpengine import LLM

    rng = random.Random(0)  # every format decodes the same prompts
    gc.collect()
    memory_before = memory_bytes(args.device)
    max_len = max(args.context_len, args.short_prompt_len) + max(args.warm_up_steps + args.steps + 2,
                                                                 args.throughput_output, args.agreement_tokens) + 8
    llm = LLM(model_path, device=args.device, max_num_seqs=max(args.batch_sizes + [args.throughput_seqs, 1]),
              max_model_len=max_len, enable_prefix_caching=False, enforce_eager=enforce_eager,
              **engine_kwargs(fmt, args))
    try:
        runner = llm.executor.runner
        # a float model's linear weights kept in another dtype (bfloat16 where the CPU computes float32)
        kept = runner.weight_dtype is not None and any(t.dtype == runner.weight_dtype and t.numel()
                                                       for t in weight_tensors(runner.model).values())
        weights = f", {str(runner.weight_dtype).removeprefix('torch.')} weights" if kept else ""
        result = dict(runs_in=str(runner.dtype).removeprefix("torch.") + weights,
                      weight_bytes=resident_weight_bytes(runner.model),
                      rss_growth=memory_bytes(args.device) - memory_before,
                      step_ms={b: decode_step_ms(llm, rng, b, args.context_len, args.steps, args.warm_up_steps)
                               for b in args.batch_sizes})
        if args.throughput_seqs:
            prompts = random_prompts(rng, args.throughput_seqs, args.short_prompt_len, llm.vocab_size)
            result["throughput_s"] = generate_seconds(llm, prompts, args.throughput_output)
        if agreement_prompts:
            result["tokens"] = greedy_tokens(llm, agreement_prompts, args.agreement_tokens)
    finally:
        llm.shutdown()
        del llm
        gc.collect()
    return result


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> tuple[float, float]:
    """(fraction of positions before each sequence's first divergence from reference, fraction equal)."""
    before, equal, total = 0, 0, 0
    for ours, theirs in zip(tokens, reference):
        pairs = list(zip(ours, theirs))
        before += next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs))
        equal += sum(a == b for a, b in pairs)
        total += len(pairs)
    return before / total, equal / total


# --- llama.cpp ------------------------------------------------------------------------------------

def gguf_files(bin_dir: str, model_path: str, names, converter: str = CONVERTER) -> dict[str, str]:
    """llama.cpp's GGUF files of the checkpoint by type (f16, Q8_0: written by converter, convert_novocab.py's
    usage; Q4_0, Q4_K_M, Q6_K, ...: by llama-quantize from the f16 one, with its default tensor mix), converted once
    and kept beside it."""
    llama_cpp = os.path.dirname(os.path.dirname(os.path.abspath(bin_dir)))  # .../llama.cpp/build/bin
    files = {}
    quantized = [name for name in names if name.lower() not in CONVERTER_TYPES]
    for name in dict.fromkeys(["f16"] * bool(quantized) + list(names)):
        path = os.path.join(model_path, f"model-{name.lower()}.gguf")
        files[name] = path
        if os.path.exists(path):
            continue
        started = time.perf_counter()
        if name in quantized:
            command = [os.path.join(bin_dir, "llama-quantize"), files["f16"], path, name]
        else:
            command = [sys.executable, converter, llama_cpp, model_path, path, name.lower()]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{shlex.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        print(f"wrote {path} in {time.perf_counter() - started:.0f}s", file=sys.stderr)
    return files


def throughput_seconds(bin_dir: str, gguf: str, prompt_len: int, output_len: int, seqs: int, threads: int) -> float:
    """llama-batched-bench's total seconds for `seqs` prompts each prefilled (no -pps), each writing output_len."""
    n_ctx = seqs * -(-(prompt_len + output_len + 16) // 256) * 256  # too small a context drops the batch
    command = [os.path.join(bin_dir, "llama-batched-bench"), "-m", gguf, "-c", str(n_ctx), "-b", "2048",
               "-ub", "512", "-npp", str(prompt_len), "-ntg", str(output_len), "-npl", str(seqs),
               "-t", str(threads), "-fa", "off", "-no-kvu", "-nr"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    rows = parse_batched_bench(done.stdout)
    if done.returncode != 0 or seqs not in rows:
        raise SystemExit(f"{shlex.join(command)} failed ({done.returncode}):\n{done.stdout[-2000:]}"
                         f"{done.stderr[-2000:]}")
    return rows[seqs]["total_s"]


def measure_llamacpp(bin_dir: str, files: dict[str, str], name: str, args) -> dict:
    """One round of llama.cpp's `name` format: decode tok/s per batch (and throughput seconds)."""
    gguf = files[name]
    decode = LlamaCppDecode(bin_dir, name, gguf, args.context_len, args.warm_up_steps + args.steps,
                            args.threads, extra=("-nr",)).step_ms(args.batch_sizes)
    result = dict(file_bytes=os.path.getsize(gguf), tok_s={b: b / ms * 1e3 for b, ms in decode.items()})
    if args.throughput_seqs:
        result["throughput_s"] = throughput_seconds(bin_dir, gguf, args.short_prompt_len, args.throughput_output,
                                                    args.throughput_seqs, args.threads)
    return result


# --- report ---------------------------------------------------------------------------------------

def table(ours: dict[str, dict], llama: dict[str, dict], args, reference: str) -> list[str]:
    base = ours.get(BASELINE)
    vs = lambda value, of: f" ({value / of:.2f}x)" if of else ""  # noqa: E731
    growth = "RSS growth at load MB" if args.device == "cpu" else "GPU memory taken at load MB (KV cache too)"
    lines = [f"| format (runs in) | resident weights MB | {growth} | "
             + " | ".join(f"batch {b} tok/s" for b in args.batch_sizes)
             + (f" | {args.throughput_seqs} seqs output tok/s" if args.throughput_seqs else "")
             + f" | top-1 vs {reference}: before first divergence, all positions |",
             "|---|---:|---:|" + "---:|" * len(args.batch_sizes) + ("---:|" if args.throughput_seqs else "") + "---|"]
    throughput_tokens = args.throughput_seqs * args.throughput_output
    for fmt, r in ours.items():
        cells = [f"{fmt} ({r['runs_in']})",
                 f"{r['weight_bytes'] / 1e6:,.0f}" + vs(r["weight_bytes"], base and base["weight_bytes"]),
                 f"{r['rss_growth'] / 1e6:,.0f}"]
        cells += [f"{r['tok_s'][b]:,.1f}" + vs(r["tok_s"][b], base and base["tok_s"][b]) for b in args.batch_sizes]
        if args.throughput_seqs:
            cells.append(f"{throughput_tokens / r['throughput_s']:,.1f}"
                         + vs(base and base["throughput_s"], r["throughput_s"]))
        cells.append(", ".join(f"{x:.0%}" for x in r["agreement"]) if "agreement" in r else "")
        lines.append("| " + " | ".join(cells) + " |")
    for name, r in llama.items():
        cells = [f"llama.cpp {name}", f"{r['file_bytes'] / 1e6:,.0f} (GGUF file)" + vs(r["file_bytes"], base and
                                                                                        base["weight_bytes"]), ""]
        cells += [f"{r['tok_s'][b]:,.1f}" + vs(r["tok_s"][b], base and base["tok_s"][b]) for b in args.batch_sizes]
        if args.throughput_seqs:
            cells.append(f"{throughput_tokens / r['throughput_s']:,.1f}"
                         + vs(base and base["throughput_s"], r["throughput_s"]))
        lines.append("| " + " | ".join(cells + [""]) + " |")
    return lines


def aims(ours: dict[str, dict], llama: dict[str, dict], args) -> list[str]:
    """The issue's aims, each met or not with its numbers (those the run measured)."""
    lines, base = [], ours.get(BASELINE)
    check = lambda ok, text: lines.append(f"- {'met' if ok else 'NOT met'}: {text}")  # noqa: E731
    if args.device == "cuda":  # the GPU issue's: FP8's step at most 0.6x bfloat16's, its throughput 1.3x
        if base is not None and "fp8" in ours:
            fp8 = ours["fp8"]
            for b in args.batch_sizes:
                ratio = fp8["step_ms"][b] / base["step_ms"][b]
                check(ratio <= 0.6, f"fp8 batch-{b} decode step <= 0.6x bfloat16's: {fp8['step_ms'][b]:.2f} vs "
                                    f"{base['step_ms'][b]:.2f} ms = {ratio:.2f}x")
            if args.throughput_seqs:
                ratio = base["throughput_s"] / fp8["throughput_s"]
                check(ratio >= 1.3, f"fp8 {args.throughput_seqs}-sequence throughput >= 1.3x bfloat16's: {ratio:.2f}x")
        return lines
    first = args.batch_sizes[0]
    for fmt, llama_name, speed_aim, weight_aim in (("int8", "Q8_0", 1.6, 0.55), ("int4", "Q4_0", 2.5, 0.3)):
        r = ours.get(fmt)
        if r is None or base is None:
            continue
        ratio = r["tok_s"][first] / base["tok_s"][first]
        check(ratio >= speed_aim, f"{fmt} batch-{first} decode >= {speed_aim}x bfloat16: {r['tok_s'][first]:,.1f} "
                                  f"vs {base['tok_s'][first]:,.1f} tok/s = {ratio:.2f}x")
        weights = r["weight_bytes"] / base["weight_bytes"]
        check(weights <= weight_aim, f"{fmt} resident weights <= {weight_aim}x bfloat16: {r['weight_bytes'] / 1e6:,.0f}"
                                     f" vs {base['weight_bytes'] / 1e6:,.0f} MB = {weights:.2f}x")
        if llama_name in llama:
            theirs = llama[llama_name]["tok_s"][first]
            check(r["tok_s"][first] >= theirs, f"{fmt} batch-{first} decode >= llama.cpp {llama_name}: "
                                               f"{r['tok_s'][first]:,.1f} vs {theirs:,.1f} tok/s")
    for name, fmt in LLAMA_FORMATS:
        if name not in llama or fmt not in ours:
            continue
        for b in (b for b in args.batch_sizes if b >= 16):
            ours_b, theirs = ours[fmt]["tok_s"][b], llama[name]["tok_s"][b]
            check(ours_b > theirs, f"{fmt} batch-{b} decode ahead of llama.cpp {name}: {ours_b:,.1f} vs {theirs:,.1f}"
                                   f" tok/s ({ours_b / theirs:.2f}x)")
        if args.throughput_seqs:
            ours_s, theirs_s = ours[fmt]["throughput_s"], llama[name]["throughput_s"]
            check(ours_s < theirs_s, f"{fmt} {args.throughput_seqs}-sequence throughput ahead of llama.cpp {name}: "
                                     f"{theirs_s / ours_s:.2f}x its output tok/s")
    return lines


def run_model(model_path: str, args) -> tuple[dict[str, dict], dict[str, dict]]:
    """Every format's best figures over args.repeat alternating rounds, then llama.cpp's."""
    rng = random.Random(1)
    vocab = json.load(open(os.path.join(model_path, "config.json")))["vocab_size"]
    prompts = random_prompts(rng, args.agreement_prompts, args.short_prompt_len, vocab)
    reference = "float32" if "float32" in args.formats else BASELINE  # the oracle; else the dtype closest to it
    ours: dict[str, dict] = {}
    llama: dict[str, dict] = {}
    files = {}
    if args.llamacpp:
        try:
            files = gguf_files(args.llamacpp, model_path, args.llamacpp_formats)
        except SystemExit as error:  # tpengine's figures still print
            print(f"llama.cpp not measured: {error}", file=sys.stderr)
    variants = [(fmt, fmt, False) for fmt in args.formats]  # (name, format, enforce_eager)
    if args.eager_too:
        variants = [v for fmt in args.formats for v in ((fmt, fmt, False), (f"{fmt} eager", fmt, True))]
    for round_ in range(args.repeat):
        for fmt, engine_format, eager in variants:
            r = measure_format(model_path, engine_format, args, prompts if round_ == 0 else None, eager)
            best = ours.setdefault(fmt, dict(r, step_ms={}, throughput_s=float("inf")))
            best["step_ms"] = {b: min(best["step_ms"].get(b, ms), ms) for b, ms in r["step_ms"].items()}
            best["throughput_s"] = min(best["throughput_s"], r.get("throughput_s", float("inf")))
            best["rss_growth"] = min(best["rss_growth"], r["rss_growth"])
            figures = ", ".join(f"batch {b} {b / ms * 1e3:,.1f} tok/s" for b, ms in r["step_ms"].items())
            print(f"[round {round_ + 1}/{args.repeat}] {fmt} ({r['runs_in']}): weights "
                  f"{r['weight_bytes'] / 1e6:,.0f} MB, {figures}, throughput {r.get('throughput_s', 0):.1f} s; "
                  f"load {load_average()}", file=sys.stderr)
        # llama.cpp in every round too, after ours, each keeping its best: the same chances on a noisy machine
        for name in args.llamacpp_formats if files else ():
            try:
                r = measure_llamacpp(args.llamacpp, files, name, args)
            except SystemExit as error:
                print(f"llama.cpp {name} not measured: {error}", file=sys.stderr)
                continue
            best = llama.setdefault(name, dict(r, tok_s={}, throughput_s=float("inf")))
            best["tok_s"] = {b: max(best["tok_s"].get(b, 0.0), v) for b, v in r["tok_s"].items()}
            if "throughput_s" in r:
                best["throughput_s"] = min(best["throughput_s"], r["throughput_s"])
            figures = ", ".join(f"batch {b} {v:,.1f} tok/s" for b, v in r["tok_s"].items())
            print(f"[round {round_ + 1}/{args.repeat}] llama.cpp {name}: {figures}; load {load_average()}",
                  file=sys.stderr)
    for r in ours.values():
        r["tok_s"] = {b: b / ms * 1e3 for b, ms in r["step_ms"].items()}
        if reference in ours and "tokens" in r:
            r["agreement"] = agreement(r["tokens"], ours[reference]["tokens"])
    for r in llama.values():
        if r["throughput_s"] == float("inf"):
            del r["throughput_s"]
    return ours, llama, reference


def main(argv=None) -> None:
    args = parse_args(argv)
    record = Record("bench_quant", argv, machine_line(args.device, torch.get_num_threads()))
    models = {}
    if args.model:
        paths = {os.path.basename(os.path.normpath(args.model)): args.model}
    elif args.quick:
        import tempfile
        scratch = tempfile.TemporaryDirectory(prefix="tpengine-quant-")  # removed when the script ends
        paths = {"quick": write_model("cpu", os.path.join(scratch.name, "model"), QUICK_MODEL)}
    else:
        paths = {name: write_model("cpu", os.path.join(CACHE, CACHED_MODEL_FOLDERS[name]), MODELS[name])
                 for name in args.models}
    sections = []
    for name, path in paths.items():
        from transformers import AutoConfig
        config = AutoConfig.from_pretrained(path)
        ours, llama, reference = run_model(path, args)
        heading = (f"{name}: hidden {config.hidden_size}, {config.num_hidden_layers} layers, vocab "
                   f"{config.vocab_size}, {'tied' if config.tie_word_embeddings else 'untied'} head "
                   f"(~{num_params(config) / 1e6:,.0f}M params)")
        sections += ["", heading, "", *table(ours, llama, args, reference), "", *aims(ours, llama, args)]
        models[name] = dict(heading=heading, path=path, tpengine={
            fmt: {k: v for k, v in r.items() if k != "tokens"} for fmt, r in ours.items()}, llama_cpp=llama)
    fields = record.fields
    print(f"command: `{fields['command']}`")
    print(f"machine: {fields['machine']}; CPU capability {torch.backends.cpu.get_cpu_capability()}"
          + (f"; GPU capability {torch.cuda.get_device_capability()}" if args.device == "cuda" else ""))
    print(f"date {fields['date']}, tpengine revision {fields['revision']}, load average (1/5/15 min) "
          f"{fields['load_average_before']} before, {load_average()} after")
    print(f"decode: context {args.context_len}, median of {args.steps} steps after {args.warm_up_steps}; throughput: "
          f"{args.throughput_seqs} prompts of {args.short_prompt_len} tokens writing {args.throughput_output} each; "
          f"best of {args.repeat} round(s); (x) = against our bfloat16; int4 groups of {args.group_size}")
    print("\n".join(sections))
    record.write(args.json, models=models)


if __name__ == "__main__":
    main()
