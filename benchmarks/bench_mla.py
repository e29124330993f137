"""DeepSeek's multi-head latent attention on the CPU: KV-cache bytes per token against Qwen3-MoE, and decode of a
V2-Lite-shaped model against llama.cpp on the same weights (issue 53, item 7), in one run.

Part 1, KV-cache bytes per token, from each model's published config.json (KV_MODELS below names the Hugging Face
repository each figure comes from):
- MLA (DeepSeek V2/V3): one vector per token and layer, the latent and the shared rotary key,
  num_layers x (kv_lora_rank + qk_rope_head_dim) x dtype bytes, whole on every tensor-parallel rank;
- GQA (Qwen3-MoE): num_layers x 2 (K and V) x kv_heads x head_dim x dtype bytes, the KV heads split over the ranks
  (replicated, one a rank, where tp exceeds them).
And measured from the engine itself, not computed: for each model a random checkpoint with its published layer count
and cache widths (kv_lora_rank and qk_rope_head_dim; num_key_value_heads and head_dim) but everything the cache does
not depend on shrunk (hidden 64, 2 experts, a 512-token vocabulary, few query heads) is loaded with
kvcache_memory_gb=--kvcache-gb at each --kv-tp; the figure is the bytes of rank 0's allocated KV-cache tensors over
the tokens its blocks hold (LLM.executor.num_kvcache_blocks x kvcache_block_size), and tokens per GiB is that token
count over the budget.

Part 2, CPU decode: a DeepSeek-V2-Lite-shaped random checkpoint with V2-Lite's real widths (vocab 102,400, hidden
2048, 16 heads, q_lora_rank none, kv_lora_rank 512, qk_nope 128, qk_rope 64, v_head_dim 128, 64 routed experts top-6
of softmax scores + 2 shared, expert intermediate 1408, first_k_dense_replace 1 with intermediate 10944, YaRN as
V2-Lite's) but --layers decoder layers instead of 27 (default 4: one dense, three MoE; ~2.2B parameters, written once
in bfloat16 to ~/.cache/tpengine-bench/), so it fits this machine's memory. Each round, for each pair, tpengine then
llama.cpp (the order flips every other round):
- tpengine (a fresh engine a round; LLM(dtype="bfloat16") and LLM(dtype="bfloat16", quantization="int8")): batch 1:
  tpengine/bench/timing.py's decode_step_ms, the median llm.step() of --steps decode steps after --warm-up-steps on
  a --context-len-token random prompt; tok/s = 1000 / ms. Batch 16: the same with 16 prompts and --batched-steps.
- llama.cpp on the same weights as GGUF (llama.cpp's own convert_hf_to_gguf.py, the vocabulary replaced by an empty
  one as ../shared/bench/llamacpp/convert_novocab.py does for Qwen3, since the checkpoint has no tokenizer; f16 from
  the converter, Q8_0 by llama-quantize from it): batch 1: `llama-bench -p 0 -n STEPS -t THREADS -fa 0 -r 3`
  (tg128: decode from an empty context), its mean tok/s; batch 16: `llama-batched-bench -npp CONTEXT -ntg
  BATCHED_STEPS -npl 16 -pps -fa off -no-kvu` (benchmarks/decode_baselines.py), its S_TG column. Both with -lm none:
  the file read into memory as tpengine holds its weights (mmap, llama.cpp's default, faults each expert's pages in
  on its first pick, inside the timed tokens). Quantized files run with no repacking (--repack 0 / -nr), as the
  README says.
Pairs: tpengine bfloat16 against llama.cpp f16, tpengine int8 against llama.cpp Q8_0. The report gives each figure's
median over the rounds, its range, and the median of the same-round ratios. tpengine uses every core (its CPU
platform sets torch's threads); llama.cpp gets -t --threads (default: every core).

    BIN=$(bash ../shared/bench/llamacpp/build.sh)
    .venv/bin/python benchmarks/bench_mla.py --llamacpp $BIN --repeat 3 --json /tmp/mla.json
    .venv/bin/python benchmarks/bench_mla.py --skip-decode          # part 1 only
    .venv/bin/python benchmarks/bench_mla.py --quick                # seconds: tiny shapes, 2 layers, no llama.cpp

--quick: part 1 with 2 layers a model at tp 1, part 2 on a tiny DeepSeek V2 shape (hidden 64), no llama.cpp unless
--llamacpp is given. Without llama.cpp's tools in --llamacpp's folder the run says llama.cpp was skipped.
`bench_mla.py --convert LLAMA_CPP_DIR HF_FOLDER OUT.gguf TYPE` is the converter step on its own.
"""
import argparse
import gc
import json
import math
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from bench_quant import resident_weight_bytes  # benchmarks/, this script's folder
from decode_baselines import LlamaCppDecode
from tpengine.bench.models import CACHE
from tpengine.bench.quick import parse_with_quick
from tpengine.bench.results import Record, add_json_flag, load_average, machine_line
from tpengine.bench.timing import decode_step_ms

DEFAULT_LLAMACPP = os.path.expanduser("~/.cache/llamacpp-anchor/llama.cpp/build/bin")
GIB = 1 << 30

# --- part 1: the published configurations -------------------------------------------------------------------------
# Values from each repository's config.json on the Hugging Face hub (the "source"); parameters as the model cards give.
KV_MODELS = {
    "DeepSeek-V2-Lite": dict(source="deepseek-ai/DeepSeek-V2-Lite", attention="MLA",
                             architecture="DeepseekV2ForCausalLM",
                             num_hidden_layers=27, kv_lora_rank=512, qk_rope_head_dim=64, num_attention_heads=16,
                             params="15.7B total, 2.4B active"),
    "DeepSeek-V3": dict(source="deepseek-ai/DeepSeek-V3", attention="MLA", architecture="DeepseekV3ForCausalLM",
                        num_hidden_layers=61, kv_lora_rank=512, qk_rope_head_dim=64, num_attention_heads=128,
                        params="671B total, 37B active"),
    "Qwen3-30B-A3B": dict(source="Qwen/Qwen3-30B-A3B", attention="GQA", architecture="Qwen3MoeForCausalLM",
                          num_hidden_layers=48, num_key_value_heads=4, head_dim=128, num_attention_heads=32,
                          params="30.5B total, 3.3B active"),
    "Qwen3-235B-A22B": dict(source="Qwen/Qwen3-235B-A22B", attention="GQA", architecture="Qwen3MoeForCausalLM",
                            num_hidden_layers=94, num_key_value_heads=4, head_dim=128, num_attention_heads=64,
                            params="235B total, 22B active"),
}
KV_BASELINE = "Qwen3-30B-A3B"  # the Qwen3-MoE of V2-Lite's class (a few B active parameters)
FORMULA_TP = (1, 2, 8)
# what the cache does not depend on, shrunk for the measured checkpoints
SHRUNK = dict(vocab_size=512, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
              max_position_embeddings=4096, tie_word_embeddings=False, initializer_range=0.02)


def formula_bytes(model: dict, tp: int, dtype_bytes: int = 2, num_layers: int | None = None) -> int:
    """KV-cache bytes per token on one rank of a tp-rank engine, from the config values."""
    layers = num_layers or model["num_hidden_layers"]
    if model["attention"] == "MLA":
        return layers * (model["kv_lora_rank"] + model["qk_rope_head_dim"]) * dtype_bytes
    kv_heads = max(1, model["num_key_value_heads"] // tp)  # more ranks than KV heads: one replicated head a rank
    return layers * 2 * kv_heads * model["head_dim"] * dtype_bytes


def kv_checkpoint_settings(model: dict, num_layers: int) -> dict:
    """write_tiny_model's settings: the model's layer count and cache widths, the rest SHRUNK."""
    settings = dict(SHRUNK, architecture=model["architecture"], num_hidden_layers=num_layers, with_tokenizer=False)
    if model["attention"] == "MLA":
        settings.update(kv_lora_rank=model["kv_lora_rank"], qk_rope_head_dim=model["qk_rope_head_dim"],
                        head_dim=model["qk_rope_head_dim"], qk_nope_head_dim=16, v_head_dim=16, num_attention_heads=2,
                        num_key_value_heads=2, n_routed_experts=2, num_experts_per_tok=1, n_shared_experts=1,
                        first_k_dense_replace=1, n_group=1, topk_group=1,
                        q_lora_rank=None if model["architecture"] == "DeepseekV2ForCausalLM" else 32)
    else:
        settings.update(num_key_value_heads=model["num_key_value_heads"], head_dim=model["head_dim"],
                        num_attention_heads=2 * model["num_key_value_heads"], num_experts=2, num_experts_per_tok=1)
    return settings


def measure_kv(path: str, tp: int, args) -> dict:
    """What the engine allocates: rank 0's KV-cache tensor bytes over the tokens its blocks hold."""
    from tpengine import LLM

    llm = LLM(path, dtype="bfloat16", kvcache_memory_gb=args.kvcache_gb, max_model_len=1024, max_num_seqs=256,
              tensor_parallel_size=tp, enforce_eager=True, warm_up=False, enable_prefix_caching=False)
    try:
        runner = llm.executor.runner  # rank 0's, in this process at any tp
        blocks, block_size = llm.executor.num_kvcache_blocks, llm.config.kvcache_block_size
        cache_bytes = sum(t.numel() * t.element_size() for t in runner.kv_cache.tensors)
        if blocks >= runner.max_num_blocks_per_seq * llm.config.max_num_seqs:
            raise SystemExit(f"{path}: the block count hit max_num_seqs x max_model_len, not the budget")
        tokens = blocks * block_size
        return dict(blocks=blocks, block_size=block_size, cache_bytes=cache_bytes, tokens=tokens,
                    bytes_per_token=cache_bytes / tokens, tokens_per_gib=tokens / args.kvcache_gb,
                    dtype=str(runner.kv_cache.dtype).removeprefix("torch."))
    finally:
        llm.shutdown()
        del llm
        gc.collect()


def kv_part(args, scratch: str) -> tuple[list[str], dict]:
    from tpengine.tiny_model import write_tiny_model

    results = {}
    for name in args.kv_models:
        model = KV_MODELS[name]
        layers = args.kv_layers or model["num_hidden_layers"]
        started = time.perf_counter()
        path = write_tiny_model(os.path.join(scratch, f"kv-{name}"), seed=0, **kv_checkpoint_settings(model, layers))
        measured = {tp: measure_kv(path, tp, args) for tp in args.kv_tp}
        results[name] = dict(layers=layers, measured=measured,
                             formula={tp: formula_bytes(model, tp, num_layers=layers) for tp in FORMULA_TP})
        print(f"[kv] {name}: {layers} layers, " + ", ".join(
            f"tp {tp}: {m['bytes_per_token']:,.0f} B/token ({m['blocks']} blocks of {m['block_size']})"
            for tp, m in measured.items()) + f"; {time.perf_counter() - started:.0f}s; load {load_average()}",
            file=sys.stderr)
    base = results.get(KV_BASELINE)
    lines = ["| model (config source) | attention | cache widths | layers | "
             + " | ".join(f"tp {tp}: formula" + (" / engine" if tp in args.kv_tp else "") for tp in FORMULA_TP)
             + f" | tokens per GiB, tp 1 (engine) | bytes against {KV_BASELINE}'s, tp 1 |",
             "|---|---|---|---:|" + "---:|" * len(FORMULA_TP) + "---:|---:|"]
    for name, r in results.items():
        model = KV_MODELS[name]
        widths = (f"{model['kv_lora_rank']} + {model['qk_rope_head_dim']}" if model["attention"] == "MLA"
                  else f"2 x {model['num_key_value_heads']} x {model['head_dim']}")
        cells = []
        for tp in FORMULA_TP:
            cell = f"{r['formula'][tp]:,} B"
            if tp in r["measured"]:
                measured = r["measured"][tp]["bytes_per_token"]
                cell += f" / {measured:,.0f} B" + ("" if measured == r["formula"][tp] else " (**differs**)")
            cells.append(cell)
        per_gib = f"{r['measured'][1]['tokens_per_gib']:,.0f}" if 1 in r["measured"] else ""
        vs = f"{r['formula'][1] / base['formula'][1]:.2f}x" if base else ""
        lines.append(f"| {name} ({model['source']}; {model['params']}) | {model['attention']} | {widths} | "
                     f"{r['layers']} | " + " | ".join(cells) + f" | {per_gib} | {vs} |")
    return lines, results


# --- part 2: decode against llama.cpp ----------------------------------------------------------------------------
# DeepSeek-V2-Lite's config.json (deepseek-ai/DeepSeek-V2-Lite), num_hidden_layers aside
V2_LITE = dict(architecture="DeepseekV2ForCausalLM", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
               moe_intermediate_size=1408, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None,
               kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, head_dim=64,
               n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, first_k_dense_replace=1,
               topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False,
               max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.02,
               rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, mscale=0.707,
                                    mscale_all_dim=0.707, beta_fast=32.0, beta_slow=1.0,
                                    original_max_position_embeddings=4096))
QUICK_V2 = dict(V2_LITE, vocab_size=1024, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                v_head_dim=16, head_dim=8, n_routed_experts=8, num_experts_per_tok=2, max_position_embeddings=4096)
PAIRS = (("bfloat16", "f16"), ("int8", "Q8_0"))  # tpengine's format, llama.cpp's of the same weights
LLAMA_TOOLS = ("llama-bench", "llama-batched-bench", "llama-quantize")


def write_checkpoint(folder: str, shape: dict, num_layers: int, dtype: torch.dtype = torch.bfloat16) -> str:
    """A random-weight checkpoint of shape with num_layers layers, written by transformers in dtype (bfloat16 keeps
    a 2B-parameter model at half float32's memory); reused when an earlier run wrote it."""
    import transformers

    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    started = time.perf_counter()
    settings = {k: v for k, v in shape.items() if k != "architecture"}
    model_class = getattr(transformers, shape["architecture"])
    config = model_class.config_class(**settings, num_hidden_layers=num_layers)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in dtype from the start: no float32 copy
    try:
        model = model_class(config)
    finally:
        torch.set_default_dtype(default)
    staging = folder + ".partial"
    model.save_pretrained(staging, safe_serialization=True)
    del model
    gc.collect()
    os.rename(staging, folder)
    print(f"wrote a random-weight {shape['architecture']} ({num_layers} layers) to {folder} in "
          f"{time.perf_counter() - started:.0f}s", file=sys.stderr)
    return folder


def convert_main(argv: list[str]) -> None:
    """--convert LLAMA_CPP_DIR HF_FOLDER OUT.gguf TYPE: llama.cpp's convert_hf_to_gguf.py for a DeepSeek V2/V3 folder
    without a tokenizer: its vocabulary step replaced by an empty vocabulary (tokenizer.ggml.model "none") plus
    vocab_size, as ../shared/bench/llamacpp/convert_novocab.py does for Qwen3."""
    import runpy

    src, model, out, outtype = argv
    sys.path[:0] = [src, os.path.join(src, "gguf-py")]
    import conversion.deepseek as deepseek  # llama.cpp's converter package

    def set_vocab_none(self):
        self._set_vocab_none()
        self.gguf_writer.add_vocab_size(self.hparams["vocab_size"])

    set_parameters = deepseek.DeepseekV2Model.set_gguf_parameters

    def set_gguf_parameters(self):
        set_parameters(self)
        # llama.cpp takes a DeepSeek V2 for "lite" (queries projected directly: no q_lora_rank key read) only at
        # V2-Lite's 27 layers (or 26); at any other count its loader requires the key, and a rank of 0 selects the
        # direct q_proj ("attn_q") as the lite path does
        if self.hparams.get("q_lora_rank") is None:
            self.gguf_writer.add_q_lora_rank(0)

    deepseek.DeepseekV2Model.set_vocab = set_vocab_none
    deepseek.DeepseekV2Model.set_gguf_parameters = set_gguf_parameters
    sys.argv = ["convert_hf_to_gguf.py", model, "--outfile", out, "--outtype", outtype]
    runpy.run_path(os.path.join(src, "convert_hf_to_gguf.py"), run_name="__main__")


def has_llamacpp(bin_dir: str | None) -> bool:
    return bool(bin_dir) and all(os.access(os.path.join(bin_dir, tool), os.X_OK) for tool in LLAMA_TOOLS)


def run(command: list[str], timeout: float = 7200) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise SystemExit(f"{shlex.join(command)} failed ({done.returncode}):\n{done.stdout[-2000:]}"
                         f"{done.stderr[-3000:]}")
    return done


def gguf_files(bin_dir: str, model_path: str) -> dict[str, str]:
    """f16 by the converter, Q8_0 by llama-quantize from it; written once beside the checkpoint."""
    llama_cpp = os.path.dirname(os.path.dirname(os.path.abspath(bin_dir)))  # .../llama.cpp/build/bin
    files = {name: os.path.join(model_path, f"model-{name.lower()}.gguf") for _, name in PAIRS}
    for name, path in files.items():
        if os.path.exists(path):
            continue
        started = time.perf_counter()
        if name == "f16":
            run([sys.executable, os.path.abspath(__file__), "--convert", llama_cpp, model_path, path + ".partial",
                 "f16"])
        else:
            run([os.path.join(bin_dir, "llama-quantize"), files["f16"], path + ".partial", name])
        os.rename(path + ".partial", path)
        print(f"wrote {path} in {time.perf_counter() - started:.0f}s", file=sys.stderr)
    return files


def measure_tpengine(path: str, fmt: str, args) -> dict:
    """A fresh engine of fmt: its resident weights and decode tok/s at every batch size."""
    from tpengine import LLM

    quantization = dict(quantization="int8") if fmt == "int8" else {}
    rng = random.Random(0)
    started = time.perf_counter()
    llm = LLM(path, dtype="bfloat16", max_num_seqs=max(args.batch_sizes), enable_prefix_caching=False,
              max_model_len=args.context_len + args.warm_up_steps + max(args.steps, args.batched_steps) + 16,
              **quantization)
    try:
        result = dict(load_s=time.perf_counter() - started,
                      weight_bytes=resident_weight_bytes(llm.executor.runner.model))
        for batch in args.batch_sizes:
            steps = args.steps if batch == 1 else args.batched_steps
            ms = decode_step_ms(llm, rng, batch, args.context_len, steps, args.warm_up_steps)
            result[batch] = batch / ms * 1e3
    finally:
        llm.shutdown()
        del llm
        gc.collect()
    return result


def measure_llamacpp(bin_dir: str, name: str, gguf: str, args) -> dict:
    """llama-bench's tg (batch 1) and llama-batched-bench's S_TG (larger batches) on the file."""
    repack = ("--repack", "0") if name != "f16" else ()
    # the whole file read into memory (-lm none), as tpengine holds its weights: mmap would fault each expert's
    # pages in on its first pick, inside the timed tokens
    load = ("-lm", args.llamacpp_load_mode)
    result = {}
    if 1 in args.batch_sizes:
        command = [os.path.join(bin_dir, "llama-bench"), "-m", gguf, "-p", "0", "-n", str(args.steps),
                   "-t", str(args.threads), "-fa", "0", "-r", str(args.llamacpp_reps), *repack, *load, "-o", "jsonl"]
        rows = [json.loads(line) for line in run(command).stdout.splitlines() if line.startswith("{")]
        if len(rows) != 1:
            raise SystemExit(f"{shlex.join(command)}: expected one result row, got {len(rows)}")
        result[1] = rows[0]["avg_ts"]
    batched = [b for b in args.batch_sizes if b > 1]
    if batched:
        extra = (("-nr",) if name != "f16" else ()) + load
        decode = LlamaCppDecode(bin_dir, name, gguf, args.context_len, args.batched_steps, args.threads, extra=extra)
        result.update({b: b / ms * 1e3 for b, ms in decode.step_ms(batched).items()})
    return result


def decode_part(args, scratch: str) -> tuple[list[str], dict]:
    if args.model:
        path = args.model
    elif args.quick:
        path = write_checkpoint(os.path.join(scratch, "v2-quick"), QUICK_V2, args.layers, torch.float32)
    else:
        path = write_checkpoint(os.path.join(CACHE, f"deepseek_v2_lite_shape_{args.layers}l"), V2_LITE, args.layers)
    with_llamacpp = not args.no_llamacpp and has_llamacpp(args.llamacpp)
    files = gguf_files(args.llamacpp, path) if with_llamacpp else {}
    ours: dict[str, list[dict]] = {fmt: [] for fmt, _ in PAIRS}
    theirs: dict[str, list[dict]] = {name: [] for _, name in PAIRS} if with_llamacpp else {}
    for round_ in range(args.repeat):
        for fmt, name in PAIRS:
            sides = [("tpengine", fmt)] + ([("llama.cpp", name)] if with_llamacpp else [])
            for engine, label in sides if round_ % 2 == 0 else sides[::-1]:
                if engine == "tpengine":
                    r = measure_tpengine(path, fmt, args)
                    ours[fmt].append(r)
                    extra = f", weights {r['weight_bytes'] / 1e6:,.0f} MB, loaded in {r['load_s']:.0f}s"
                else:
                    r = measure_llamacpp(args.llamacpp, name, files[name], args)
                    theirs[name].append(r)
                    extra = ""
                figures = ", ".join(f"batch {b} {r[b]:,.2f} tok/s" for b in args.batch_sizes)
                print(f"[round {round_ + 1}/{args.repeat}] {engine} {label}: {figures}{extra}; load {load_average()}",
                      file=sys.stderr)
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(path)
    num_params = sum(math.prod(shape) for shape in _tensor_shapes(path))
    heading = (f"{'a tiny DeepSeek V2 shape' if args.quick and not args.model else 'DeepSeek-V2-Lite shape'}: "
               f"{config.num_hidden_layers} layers (V2-Lite has 27), hidden {config.hidden_size}, "
               f"{config.n_routed_experts} experts top-{config.num_experts_per_tok} + {config.n_shared_experts} "
               f"shared, kv_lora_rank {config.kv_lora_rank}, vocab {config.vocab_size}; "
               f"{num_params / 1e6:,.1f}M parameters ({path})")
    lines = ["| batch | tpengine format | tpengine tok/s, median (rounds) | llama.cpp file | llama.cpp tok/s, median "
             "(rounds) | tpengine / llama.cpp, median of the same-round ratios (range) |",
             "|---:|---|---|---|---|---|"]
    spread = lambda values: f"{statistics.median(values):,.2f} ({', '.join(f'{v:,.2f}' for v in values)})"  # noqa
    for batch in args.batch_sizes:
        for fmt, name in PAIRS:
            mine = [r[batch] for r in ours[fmt]]
            row = f"| {batch} | {fmt} | {spread(mine)} | "
            if name in theirs and theirs[name]:
                other = [r[batch] for r in theirs[name]]
                ratios = [a / b for a, b in zip(mine, other)]
                row += (f"{name} | {spread(other)} | {statistics.median(ratios):.2f}x "
                        f"({min(ratios):.2f}-{max(ratios):.2f}x) |")
            else:
                row += "(skipped) | | |"
            lines.append(row)
    weights = ", ".join(f"{fmt} {ours[fmt][0]['weight_bytes'] / 1e6:,.0f} MB" for fmt, _ in PAIRS)
    lines += ["", f"tpengine's resident weights: {weights}"
              + ("; llama.cpp's files: "
                 + ", ".join(f"{n} {os.path.getsize(p) / 1e6:,.0f} MB" for n, p in files.items()) if files else "")]
    if not with_llamacpp:
        lines.append("llama.cpp skipped: " + ("--quick or --no-llamacpp" if args.no_llamacpp else
                                              f"no {', '.join(LLAMA_TOOLS)} in {args.llamacpp}")
                     + " (../shared/bench/llamacpp/README.md builds them)")
    return [heading, "", *lines], dict(path=path, heading=heading, tpengine=ours, llama_cpp=theirs,
                                       files=files)


def _tensor_shapes(path: str):
    """The shape of every tensor in the checkpoint's safetensors files (read from their headers)."""
    from safetensors import safe_open
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                for key in f.keys():
                    yield f.get_slice(key).get_shape()


# --- main --------------------------------------------------------------------------------------------------------

def cpu_flags() -> str:
    """The vector extensions /proc/cpuinfo lists (what decides which kernels both engines run)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line.split(":", 1)[1].split() for line in f if line.startswith("flags"))
    except (OSError, StopIteration):
        return "n/a"
    wanted = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
              "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")
    return " ".join(flag for flag in wanted if flag in flags) or "none of " + " ".join(wanted)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kv-models", nargs="+", choices=tuple(KV_MODELS), default=list(KV_MODELS))
    p.add_argument("--kv-tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes measured in part 1")
    p.add_argument("--kv-layers", type=int, help="part 1's checkpoints' layers (default: each model's published)")
    p.add_argument("--kvcache-gb", type=float, default=1.0, help="part 1's kvcache_memory_gb")
    p.add_argument("--layers", type=int, default=4, help="part 2's V2-Lite-shaped checkpoint's decoder layers")
    p.add_argument("--model", help="part 2 on this DeepSeek checkpoint folder instead of the written one")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--context-len", type=int, default=16, help="prompt tokens before tpengine's timed decode steps")
    p.add_argument("--steps", type=int, default=128, help="batch 1's decode steps (llama-bench's -n: tg128)")
    p.add_argument("--batched-steps", type=int, default=32, help="decode steps timed at batches above 1")
    p.add_argument("--warm-up-steps", type=int, default=4)
    p.add_argument("--repeat", type=int, default=3, help="rounds, the engines alternating; medians reported")
    p.add_argument("--llamacpp", metavar="BIN", default=DEFAULT_LLAMACPP,
                   help="llama.cpp's build/bin (../shared/bench/llamacpp/build.sh); absent: tpengine alone")
    p.add_argument("--no-llamacpp", action="store_true", help="tpengine alone")
    p.add_argument("--llamacpp-reps", type=int, default=3, help="llama-bench's -r in each round")
    p.add_argument("--llamacpp-load-mode", default="none",
                   help="llama.cpp's -lm (none: the file read into memory; mmap: its default)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp's -t")
    p.add_argument("--skip-kv", action="store_true", help="no part 1")
    p.add_argument("--skip-decode", action="store_true", help="no part 2")
    add_json_flag(p)
    argv = sys.argv[1:] if argv is None else argv
    explicit_llamacpp = "--llamacpp" in argv
    args = parse_with_quick(p, argv, dict(kv_tp=[1], kv_layers=2, kvcache_gb=0.25, layers=2, batch_sizes=[1, 2],
                                          steps=4, batched_steps=4, warm_up_steps=1, repeat=1, llamacpp_reps=1),
                            "a tiny DeepSeek V2 shape in part 2; no llama.cpp unless --llamacpp is given")
    if args.quick and not explicit_llamacpp:
        args.no_llamacpp = True
    if min(args.batch_sizes + args.kv_tp + [args.layers, args.context_len, args.steps, args.batched_steps,
                                            args.repeat, args.llamacpp_reps, args.threads]) < 1 \
            or args.warm_up_steps < 0 or not args.kvcache_gb > 0:
        p.error("sizes and counts must be >= 1 (--warm-up-steps >= 0, --kvcache-gb > 0)")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    record = Record("bench_mla", argv, machine_line("cpu", torch.get_num_threads()))
    scratch = tempfile.TemporaryDirectory(prefix="tpengine-mla-")
    sections, figures = [], {}
    if not args.skip_kv:
        lines, figures["kv"] = kv_part(args, scratch.name)
        sections += ["", "KV-cache bytes per token and rank, bfloat16 cache (formula from the published config / "
                     f"what tpengine allocates, kvcache_memory_gb={args.kvcache_gb}; tp 8 formula only):", "", *lines]
    if not args.skip_decode:
        lines, figures["decode"] = decode_part(args, scratch.name)
        sections += ["", f"Decode tok/s, {args.repeat} round(s) (tpengine and llama.cpp alternating), batch 1: "
                     f"tpengine's median step of {args.steps} after a {args.context_len}-token prompt, llama-bench tg"
                     f"{args.steps} (-r {args.llamacpp_reps}); batches above 1: {args.batched_steps} steps, "
                     f"llama-batched-bench -pps:", "", *lines]
    fields = record.fields
    print(f"command: `{fields['command']}`")
    print(f"machine: {fields['machine']}; CPU capability {torch.backends.cpu.get_cpu_capability()}; "
          f"CPU flags: {cpu_flags()}")
    print(f"date {fields['date']}, tpengine revision {fields['revision']}, load average (1/5/15 min) "
          f"{fields['load_average_before']} before, {load_average()} after")
    print("\n".join(sections))
    record.write(args.json, cpu_flags=cpu_flags(), **figures)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--convert"]:
        convert_main(sys.argv[2:])
    else:
        main()
