"""GGUF files as llama.cpp users hold them: tpengine against llama.cpp on the same file (issue 48, part 4).

Models (random weights, written once and cached in ~/.cache/tpengine-bench/, each with its GGUF files beside it):
- qwen3-0.6b: Qwen3-0.6B's shape (tpengine.bench's QWEN3_0_6B: vocab 151,936, 28 layers, hidden 1024, tied head).
- llama-3.2-1b: Llama-3.2-1B's shape (vocab 128,256, 16 layers, hidden 2048, intermediate 8192, 32 heads / 8 KV
  heads of 64, tied head, llama3 rope scaling; ~1.24B parameters).

Files: ../shared/bench/llamacpp/convert_novocab.py (through convert_novocab_llama.py, which extends it to Llama)
writes the checkpoint as f16 (and Q8_0) GGUF with an empty vocabulary (tokenizer.ggml.model "none"); llama-quantize
makes Q4_K_M, Q4_0 and Q6_K from the f16 one with its default tensor mix (bench_quant.gguf_files does both).
tpengine loads each file as a user would, LLM("x.gguf"), with tokenizer= a byte-level tokenizer folder
(tpengine.tiny_model.write_byte_tokenizer): transformers builds no tokenizer from a file whose tokenizer.ggml.model is
"none" (a ValueError says so). The figures feed token ids, so the tokenizer only has to load.

Each round takes every file in turn, llama.cpp first, then tpengine on the same file, so drift on a shared machine
touches both alike; each figure keeps its best round (every round is printed):
- llama.cpp: `llama-bench -m F -p PROMPT -n STEPS -t THREADS -fa 0 --repack 0 -r 1 -o jsonl` for pp512 and tg128
  (decode from an empty context, one sequence), and `llama-batched-bench -npp CONTEXT -ntg STEPS -npl 16 -pps -fa off
  -no-kvu -nr` (benchmarks/decode_baselines.py) for decode at batch 16, its S_TG column. No repacking: the AMX repack
  path crashes on these VMs.
- tpengine, a fresh engine per file and round (prefix caching off; --dtype, --gguf-activations): resident weight bytes
  (bench_quant's count: every parameter and packed form a layer holds, each tensor once) against the file's tensor
  bytes (the process's RSS growth over the load goes to --json beside it, a rough cross-check); decode at batch 1 and
  16 (tpengine/bench/timing.py's decode_step_ms: CONTEXT-token random prompts, the median llm.step() over STEPS
  steps after WARM_UP); prefill (pp512): the median time of one PROMPT-token prompt's prefill step (max_tokens=1),
  over --prefill-repeats after one untimed.
The issue's aims, each printed as met or not: batch-1 decode >= 1.2x llama.cpp's for Q4_K_M, Q4_0, Q8_0, Q6_K; batch
16 >= 1.5x; pp512 >= 1.0x; resident weights <= 1.1x the file's tensor bytes.

    BIN=$(bash ../shared/bench/llamacpp/build.sh)
    .venv/bin/python benchmarks/bench_gguf.py --llamacpp $BIN --repeat 2 --json /tmp/gguf.json   # ~40 min
    .venv/bin/python benchmarks/bench_gguf.py --models qwen3-0.6b --types Q4_0 --repeat 1
    .venv/bin/python benchmarks/bench_gguf.py --quick   # seconds: QUICK_MODEL; llama.cpp only if --llamacpp exists

--quick writes tpengine.bench's QUICK_MODEL; where --llamacpp's folder is absent (the default's, on a machine that
never built it) it writes Q8_0 and Q4_0 files with the gguf package's own writer and quantizer (it has none for
K-quants), runs tpengine alone and says llama.cpp was skipped.
"""
import argparse
import gc
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from bench_quant import gguf_files, memory_bytes, resident_weight_bytes  # benchmarks/, this script's folder
from decode_baselines import LlamaCppDecode
from tpengine.bench.models import CACHE, CACHED_MODEL_FOLDERS, QUICK_MODEL, QWEN3_0_6B, ROPE, write_model
from tpengine.bench.quick import parse_with_quick
from tpengine.bench.results import Record, add_json_flag, load_average, machine_line
from tpengine.bench.timing import decode_step_ms
from tpengine.bench.workload import random_prompts

LLAMA_3_2_1B = dict(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                    num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                    max_position_embeddings=131072, tie_word_embeddings=True, rms_norm_eps=1e-5,
                    initializer_range=0.02, rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0,
                                                                 low_freq_factor=1.0, high_freq_factor=4.0,
                                                                 original_max_position_embeddings=8192))
MODELS = {"qwen3-0.6b": (QWEN3_0_6B, CACHED_MODEL_FOLDERS["qwen3-0.6b"]),
          "llama-3.2-1b": (LLAMA_3_2_1B, "llama_3_2_1b_shape_model")}
TYPES = ("Q4_K_M", "Q4_0", "Q8_0", "Q6_K")
QUICK_TYPES = ("Q8_0", "Q4_0")  # what gguf's own quantizer writes (no K-quants): --quick without llama.cpp
DEFAULT_LLAMACPP = os.path.expanduser("~/.cache/llamacpp-anchor/llama.cpp/build/bin")
LLAMA_CONVERTER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "convert_novocab_llama.py")
AIMS = dict(batch_1=1.2, batch_16=1.5, pp=1.0, weights=1.1)  # ratios to llama.cpp (weights: to the file's)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=tuple(MODELS), default=list(MODELS))
    p.add_argument("--types", nargs="+", default=list(TYPES), help="llama-quantize types (f16, Q8_0, Q4_K_M, ...)")
    p.add_argument("--llamacpp", metavar="BIN", default=DEFAULT_LLAMACPP,
                   help="llama.cpp's build/bin (../shared/bench/llamacpp/build.sh); absent: tpengine alone")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16",
                   help="tpengine's activations and KV cache (the weights stay in each file's own types)")
    p.add_argument("--gguf-activations", choices=("auto", "float"), default="auto",
                   help="tpengine's gguf_activations: auto quantizes each token's input to int8 on the CPU (as "
                        "llama.cpp does), float multiplies it as it is")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="llama.cpp's -t")
    p.add_argument("--context-len", type=int, default=16, help="prompt tokens before the timed decode steps")
    p.add_argument("--steps", type=int, default=128, help="decode steps timed (llama-bench's -n: tg128)")
    p.add_argument("--warm-up-steps", type=int, default=4)
    p.add_argument("--decode-batch", type=int, default=16, help="the batched decode's sequences")
    p.add_argument("--prompt-len", type=int, default=512, help="the prefill's prompt (llama-bench's -p: pp512)")
    p.add_argument("--prefill-repeats", type=int, default=3, help="tpengine's timed prefills per round (median)")
    p.add_argument("--repeat", type=int, default=1, help="rounds over the files, alternating engines; best kept")
    add_json_flag(p)
    # llama-batched-bench prints "inf" tok/s for a phase under a millisecond: 32 prompt tokens and 16 steps keep it
    args = parse_with_quick(p, argv, dict(types=list(QUICK_TYPES), context_len=32, steps=16, warm_up_steps=1,
                                          decode_batch=4, prompt_len=32, prefill_repeats=1),
                            "tpengine.bench's QUICK_MODEL instead of --models'")
    if min(args.context_len, args.steps, args.decode_batch, args.prompt_len, args.prefill_repeats, args.repeat,
           args.threads) < 1 or args.warm_up_steps < 0:
        p.error("sizes and counts must be >= 1 (--warm-up-steps >= 0)")
    return args


# --- files ----------------------------------------------------------------------------------------

def has_llamacpp(bin_dir: str) -> bool:
    return all(os.access(os.path.join(bin_dir, tool), os.X_OK)
               for tool in ("llama-bench", "llama-batched-bench", "llama-quantize"))


def model_files(model_path: str, args) -> dict[str, str]:
    """type -> GGUF file of the checkpoint: llama.cpp's converter and quantizer where its tools are there, else
    gguf's own writer (Q8_0 and Q4_0 of a Qwen3)."""
    if has_llamacpp(args.llamacpp):
        files = gguf_files(args.llamacpp, model_path, args.types, converter=LLAMA_CONVERTER)
        return {name: files[name] for name in args.types}
    unwritable = [name for name in args.types if name not in QUICK_TYPES]
    if unwritable:
        raise SystemExit(f"no llama.cpp in {args.llamacpp} to quantize {', '.join(unwritable)}: gguf's own quantizer "
                         f"writes {', '.join(QUICK_TYPES)} here")
    return {name: write_gguf(model_path, os.path.join(model_path, f"model-{name.lower()}.gguf"), name)
            for name in args.types}


def write_gguf(folder: str, path: str, kind: str) -> str:
    """A Qwen3 checkpoint folder as a GGUF file of kind (F32, Q8_0, Q4_0, ...: those gguf's quantizer writes), as
    convert_novocab.py writes one (llama.cpp's metadata and tensor names, an empty vocabulary; norms in F32)."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter, quants
    from safetensors.numpy import load_file

    from tpengine.gguf.config import ARCHITECTURES
    from tpengine.gguf.tensors import hf_name, layer_names

    config = json.load(open(os.path.join(folder, "config.json")))
    if config["model_type"] != "qwen3":
        raise SystemExit(f"{folder}: without llama.cpp's converter only a Qwen3 checkpoint is written as GGUF here")
    writer = GGUFWriter(path, "qwen3")
    metadata = {"block_count": "num_hidden_layers", "context_length": "max_position_embeddings",
                "embedding_length": "hidden_size", "feed_forward_length": "intermediate_size",
                "head_count": "num_attention_heads", "head_count_kv": "num_key_value_heads", "key_length": "head_dim",
                "value_length": "head_dim", "layer_norm_rms_eps": "rms_norm_eps", "vocab_size": "vocab_size"}
    for gguf_key, key in metadata.items():  # GGUFWriter.add_block_count(...), ...
        getattr(writer, f"add_{gguf_key}")(config[key])
    writer.add_rope_freq_base(config.get("rope_theta") or config["rope_parameters"]["rope_theta"])
    writer.add_tokenizer_model("none")
    stems = ["token_embd", "output_norm", "output"] + [f"blk.{i}.{stem}" for i in range(config["num_hidden_layers"])
                                                       for stem in layer_names(ARCHITECTURES["qwen3"])]
    names = {hf_name(f"{stem}.weight"): f"{stem}.weight" for stem in stems}
    for name, weights in load_file(os.path.join(folder, "model.safetensors")).items():
        kind_of = GGMLQuantizationType.F32 if weights.ndim == 1 else GGMLQuantizationType[kind]
        writer.add_tensor(names[name], quants.quantize(weights.astype(np.float32), kind_of), raw_dtype=kind_of)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tensor_bytes(path: str) -> int:
    """The bytes of a GGUF file's tensors (its metadata left out)."""
    from tpengine.gguf.files import open_gguf
    return sum(int(t.n_bytes) for t in open_gguf(path).tensors.values())


# --- tpengine -------------------------------------------------------------------------------------

def prefill_ms(llm, rng: random.Random, prompt_len: int, repeats: int) -> float:
    """Median ms to prefill one prompt_len-token random prompt (max_tokens=1: the prefill step writes the only
    token), over `repeats` after one untimed."""
    from tpengine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for _ in range(repeats + 1):
        llm.add_request(random_prompts(rng, 1, prompt_len, llm.vocab_size)[0], params, stream=False)
        started = time.perf_counter()
        while llm.has_unfinished_requests():
            llm.step()
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:]) * 1e3


def measure_tpengine(path: str, tokenizer: str, args) -> dict:
    """One fresh engine on the file: resident weights, decode tok/s at batch 1 and args.decode_batch, prefill tok/s."""
    from tpengine import LLM

    rng = random.Random(0)
    gc.collect()  # the last engine's memory goes back first, or its release counts against this one's growth
    memory_before = memory_bytes("cpu")
    started = time.perf_counter()
    llm = LLM(path, tokenizer=tokenizer, device="cpu", dtype=args.dtype, max_num_seqs=args.decode_batch,
              max_model_len=max(args.prompt_len, args.context_len + args.warm_up_steps + args.steps + 2) + 8,
              enable_prefix_caching=False, gguf_activations=args.gguf_activations)
    try:
        result = dict(load_s=time.perf_counter() - started, rss_growth=memory_bytes("cpu") - memory_before,
                      weight_bytes=resident_weight_bytes(llm.executor.runner.model))
        for batch in (1, args.decode_batch):
            ms = decode_step_ms(llm, rng, batch, args.context_len, args.steps, args.warm_up_steps)
            result[f"decode_{batch}"] = batch / ms * 1e3
        result["prefill"] = args.prompt_len / prefill_ms(llm, rng, args.prompt_len, args.prefill_repeats) * 1e3
    finally:
        llm.shutdown()
        del llm
        gc.collect()
    return result


# --- llama.cpp ------------------------------------------------------------------------------------

def llama_bench(bin_dir: str, path: str, args) -> dict[str, float]:
    """llama-bench's pp and tg tok/s on the file (one repetition after its own warm-up)."""
    command = [os.path.join(bin_dir, "llama-bench"), "-m", path, "-p", str(args.prompt_len), "-n", str(args.steps),
               "-t", str(args.threads), "-fa", "0", "--repack", "0", "-r", "1", "-o", "jsonl"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    figures = {("prefill" if row["n_prompt"] else "decode_1"): row["avg_ts"] for row in rows}
    if done.returncode != 0 or set(figures) != {"prefill", "decode_1"}:
        raise SystemExit(f"{shlex.join(command)} failed ({done.returncode}):\n{done.stdout[-2000:]}"
                         f"{done.stderr[-2000:]}")
    return figures


def measure_llamacpp(bin_dir: str, path: str, args) -> dict:
    """One round of llama.cpp on the file: llama-bench's pp and tg, then llama-batched-bench's batched decode."""
    result, batch = llama_bench(bin_dir, path, args), args.decode_batch
    batched = LlamaCppDecode(bin_dir, "", path, args.context_len, args.steps, args.threads, extra=("-nr",))
    result[f"decode_{batch}"] = batch / batched.step_ms([batch])[batch] * 1e3
    return result


# --- rounds and report ----------------------------------------------------------------------------

def keep_best(best: dict, name: str, result: dict) -> None:
    """best[name] keeps each figure's best round: the most tok/s, the least of the rest (bytes, seconds)."""
    kept = best.setdefault(name, dict(result))
    for key, value in result.items():
        kept[key] = max(kept[key], value) if key.startswith(("decode", "prefill")) else min(kept[key], value)


def run_model(files: dict[str, str], tokenizer: str, args, with_llamacpp: bool) -> tuple[dict, dict]:
    """(tpengine's, llama.cpp's) best figures by file over args.repeat rounds, llama.cpp first on each file."""
    ours, theirs = {}, {}
    for round_ in range(args.repeat):
        for name, path in files.items():
            tag = f"[round {round_ + 1}/{args.repeat}] {name}"
            if with_llamacpp:
                r = measure_llamacpp(args.llamacpp, path, args)
                keep_best(theirs, name, r)
                print(f"{tag} llama.cpp: {figures_line(r, args)}; load {load_average()}", file=sys.stderr)
            r = measure_tpengine(path, tokenizer, args)
            keep_best(ours, name, r)
            print(f"{tag} tpengine: {figures_line(r, args)}, weights {r['weight_bytes'] / 1e6:,.0f} MB, loaded in "
                  f"{r['load_s']:.1f}s; load {load_average()}", file=sys.stderr)
    return ours, theirs


def figures_line(r: dict, args) -> str:
    return (f"batch 1 {r['decode_1']:,.1f} tok/s, batch {args.decode_batch} {r[f'decode_{args.decode_batch}']:,.1f} "
            f"tok/s, pp{args.prompt_len} {r['prefill']:,.1f} tok/s")


def table(ours: dict, theirs: dict, files: dict[str, str], args) -> list[str]:
    keys = ("decode_1", f"decode_{args.decode_batch}", "prefill")
    lines = [f"| file | engine | batch 1 tg{args.steps} tok/s | batch {args.decode_batch} decode tok/s | "
             f"pp{args.prompt_len} tok/s | weights MB |", "|---|---|---:|---:|---:|---:|"]
    for name, path in files.items():
        r, size = ours[name], tensor_bytes(path)
        if name in theirs:
            lines.append(f"| {name} | llama.cpp | " + " | ".join(f"{theirs[name][k]:,.1f}" for k in keys)
                         + f" | {size / 1e6:,.0f} (file's tensors) |")
        ratio = lambda k: f" ({r[k] / theirs[name][k]:.2f}x)" if name in theirs else ""  # noqa: E731
        lines.append(f"| {name} | tpengine | " + " | ".join(f"{r[k]:,.1f}{ratio(k)}" for k in keys)
                     + f" | {r['weight_bytes'] / 1e6:,.0f} ({r['weight_bytes'] / size:.2f}x) |")
    return lines


def aims(ours: dict, theirs: dict, files: dict[str, str], args) -> list[str]:
    lines = []
    for name, path in files.items():
        r, size = ours[name], tensor_bytes(path)
        weights = r["weight_bytes"] / size
        checks = [(weights <= AIMS["weights"], f"resident weights <= {AIMS['weights']}x the file's tensor bytes: "
                   f"{r['weight_bytes'] / 1e6:,.0f} vs {size / 1e6:,.0f} MB = {weights:.2f}x")]
        if name in theirs:
            for key, aim, what in (("decode_1", AIMS["batch_1"], "batch-1 decode"),
                                   (f"decode_{args.decode_batch}", AIMS["batch_16"],
                                    f"batch-{args.decode_batch} decode"),
                                   ("prefill", AIMS["pp"], f"pp{args.prompt_len}")):
                ratio = r[key] / theirs[name][key]
                checks.append((ratio >= aim, f"{what} >= {aim}x llama.cpp: {r[key]:,.1f} vs {theirs[name][key]:,.1f} "
                                             f"tok/s = {ratio:.2f}x"))
        lines += [f"- {name}: {'met' if ok else 'NOT met'}: {text}" for ok, text in checks]
    return lines


def main(argv=None) -> None:
    args = parse_args(argv)
    record = Record("bench_gguf", argv, machine_line("cpu", torch.get_num_threads()))
    with_llamacpp = has_llamacpp(args.llamacpp)
    scratch = tempfile.TemporaryDirectory(prefix="tpengine-gguf-")  # the tokenizer (and --quick's model)
    from tpengine.tiny_model import write_byte_tokenizer
    tokenizer = os.path.join(scratch.name, "tokenizer")
    write_byte_tokenizer(tokenizer)
    if args.quick:
        paths = {"quick": write_model("cpu", os.path.join(scratch.name, "model"), QUICK_MODEL)}
    else:
        paths = {name: write_model("cpu", os.path.join(CACHE, MODELS[name][1]), MODELS[name][0])
                 for name in args.models}
    sections, models = [], {}
    for name, path in paths.items():
        files = model_files(path, args)
        ours, theirs = run_model(files, tokenizer, args, with_llamacpp)
        sections += ["", f"{name} ({path})", "", *table(ours, theirs, files, args), "",
                     *aims(ours, theirs, files, args)]
        models[name] = dict(path=path, files={k: dict(path=p, tensor_bytes=tensor_bytes(p)) for k, p in files.items()},
                            tpengine=ours, llama_cpp=theirs)
    fields = record.fields
    print(f"command: `{fields['command']}`")
    print(f"machine: {fields['machine']}; CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"date {fields['date']}, tpengine revision {fields['revision']}, load average (1/5/15 min) "
          f"{fields['load_average_before']} before, {load_average()} after")
    print(f"tpengine {args.dtype}, gguf_activations={args.gguf_activations}; decode: {args.context_len}-token "
          f"prompts, median of {args.steps} steps after {args.warm_up_steps}; pp{args.prompt_len}: median of "
          f"{args.prefill_repeats}; best of {args.repeat} round(s)")
    if not with_llamacpp:
        print(f"llama.cpp skipped: no llama-bench, llama-batched-bench and llama-quantize in {args.llamacpp} "
              "(../shared/bench/llamacpp/README.md builds them)")
    print("\n".join(sections))
    record.write(args.json, models=models)


if __name__ == "__main__":
    main()
