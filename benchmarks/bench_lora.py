"""Multi-LoRA on the CPU (issue 49): what adapters cost a decode step, and what loading one costs, in one run.

Decode (model: tpengine.bench's LOW_BATCH_MODEL, the folder bench_low_batch.py and bench_spec.py use, or --model;
--quick: QUICK_MODEL). Two engines, prefix caching off: one without LoRA, one with enable_lora=True,
max_loras=--num-adapters, max_lora_rank=--rank. Adapters are random rank --rank PEFT folders on every q/k/v/o/gate/
up/down projection, written here without peft (adapter_config.json and adapter_model.safetensors in peft's key
names). At each --batch-sizes batch, --batch-sizes sequences of --context-len random prompt tokens decode together
(greedy, ignore_eos), and the median wall time of llm.step() over --steps decode steps after their prefill and
--warm-up-steps untimed steps is the step time of:

- no LoRA: the engine without enable_lora;
- LoRA on, base rows: the LoRA engine, no row on an adapter (the aims' base: what a LoRA server's plain rows pay);
- one adapter, every row: the LoRA engine, every row on adapter 1;
- N adapters, rows spread: the LoRA engine, row i on adapter i mod N (batches of at least N rows).

Every round (--repeat) runs every configuration at every batch, the order rotating round by round, so a machine
whose speed drifts affects each alike; a ratio is the median over rounds of the two configurations' ratio in the
same round, and each figure gives the median and the range over rounds.

Load: the time from an adapter's folder on disk to its weights in a slot, on the engine's own objects
(runner.lora: LoRAAdapters._parts_of, which reads the folder with read_adapter_weights and maps its modules to our
layers, then LoRAWeights.write_slot on every LoRA layer, as LoRAAdapters.apply does before a step's forward), for
a rank --rank adapter on Qwen3-0.6B's layer shape (hidden 1024, 16 heads / 8 KV heads of 128, intermediate 3072)
in --load-dtype, with --load-layers of its 28 layers (a smaller vocabulary: the embedding plays no part); a count
below 28 is scaled to 28 (the work is per layer) and the table says so. Each repetition reads a fresh adapter id,
so nothing comes from the host cache; the host-cached reload (an adapter evicted from its slot but still read) is
timed too. Then the first request's latency end to end: llm.generate of one --first-prompt-len prompt (16
tokens), max_tokens 1, on an adapter not yet loaded (a fresh id: read, written, then the prefill) against one
already resident, against no adapter; median of --load-repeat. --load-layers 0 (what --quick sets) times the
loads on the decode engine instead.

The LoRA op's share: on the LoRA engine's own layers, per decode step of each batch, the base matmuls of every
LoRA linear against its LoRA add (rows on no adapter, on one, spread over --num-adapters row by row, and the same
adapters in runs of rows), called directly.

Aims (issue 49): every row on one rank-16 adapter at most 1.15x a base step at batch 1 and 16; 4 adapters in a
batch of 16 at most 1.3x; loading a rank-16 adapter on the 0.6B shape under 100 ms.

    .venv/bin/python benchmarks/bench_lora.py                      # a few minutes on 2 cores
    .venv/bin/python benchmarks/bench_lora.py --repeat 5 --batch-sizes 1 4 16 --json lora.json
    .venv/bin/python benchmarks/bench_lora.py --quick              # seconds: QUICK_MODEL
"""
import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

import torch

from tpengine.bench.models import (CACHE, CACHED_MODEL_FOLDERS, LOW_BATCH_MODEL, QUICK_MODEL, QWEN3_0_6B, model_fields,
                                   write_model)
from tpengine.bench.quick import parse_with_quick
from tpengine.bench.results import Record, add_json_flag, load_average, machine_line
from tpengine.bench.timing import prompts_decode_step_ms
from tpengine.bench.workload import random_prompts

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
QWEN3_0_6B_LAYERS = QWEN3_0_6B["num_hidden_layers"]
LOAD_VOCAB = 8192  # the load model's vocabulary: the embedding plays no part in a load
ONE_ADAPTER_AIM, MIXED_AIM, LOAD_AIM_MS = 1.15, 1.3, 100.0
NO_LORA, BASE, ONE, MIXED = "no LoRA", "LoRA on, base rows", "one adapter, every row", "adapters, rows spread"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="existing checkpoint folder (default: the random LOW_BATCH_MODEL Qwen3)")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16], help="decode batches timed")
    p.add_argument("--context-len", type=int, default=208, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=30, help="decode steps timed per configuration and batch")
    p.add_argument("--warm-up-steps", type=int, default=5)
    p.add_argument("--repeat", type=int, default=3, help="rounds, the configurations' order rotating")
    p.add_argument("--rank", type=int, default=16, help="the adapters' rank (and max_lora_rank)")
    p.add_argument("--num-adapters", type=int, default=4, help="adapters spread over a batch (and max_loras)")
    p.add_argument("--load-layers", type=int, default=QWEN3_0_6B_LAYERS,
                   help="layers of the 0.6B-shaped model the loads are timed on (scaled to 28); 0: the decode engine")
    p.add_argument("--load-dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--first-prompt-len", type=int, default=16, help="the first-request rows' prompt tokens")
    p.add_argument("--load-repeat", type=int, default=7, help="loads timed (each a fresh adapter id)")
    add_json_flag(p)
    args = parse_with_quick(p, argv, dict(batch_sizes=[1, 4], context_len=16, steps=3, warm_up_steps=1, repeat=1,
                                          load_layers=0, load_repeat=2), "QUICK_MODEL")
    if min(args.batch_sizes + [args.context_len, args.steps, args.repeat, args.rank, args.num_adapters,
                               args.load_repeat]) < 1 or args.load_layers < 0:
        p.error("sizes and counts must be >= 1 (--load-layers >= 0)")
    return args


# --- adapters, without peft --------------------------------------------------------------------------------------

def projection_shapes(config) -> dict[str, tuple[str, int, int]]:
    """{projection: (its block, in_features, out_features)} of a Qwen3-shaped config."""
    hidden, head_dim, inter = config["hidden_size"], config["head_dim"], config["intermediate_size"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    return {"q_proj": ("self_attn", hidden, q), "k_proj": ("self_attn", hidden, kv),
            "v_proj": ("self_attn", hidden, kv), "o_proj": ("self_attn", q, hidden),
            "gate_proj": ("mlp", hidden, inter), "up_proj": ("mlp", hidden, inter), "down_proj": ("mlp", inter, hidden)}


def write_adapter(folder: str, config: dict, rank: int, seed: int, targets=TARGETS) -> str:
    """A PEFT LoRA folder as peft's save_pretrained writes one: adapter_config.json and adapter_model.safetensors
    with A [r, in] and B [out, r] under peft's keys, drawn at random (peft leaves B zero), alpha = 2 r."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name, (block, fan_in, fan_out) in projection_shapes(config).items():
            if name not in targets:
                continue
            key = f"base_model.model.model.layers.{layer}.{block}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) / fan_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.01
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(dict(peft_type="LORA", task_type="CAUSAL_LM", r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                       target_modules=list(targets), bias="none", use_rslora=False, use_dora=False,
                       base_model_name_or_path=None), f, indent=1)
    return folder


def read_config(model_path: str) -> dict:
    with open(os.path.join(model_path, "config.json")) as f:
        return json.load(f)


# --- decode ------------------------------------------------------------------------------------------------------

def make_engine(model: str, args, lora: bool, max_batch: int | None = None, dtype: str | None = None):
    from tpengine import LLM

    max_batch = max_batch or max(args.batch_sizes)
    settings = dict(enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.rank) if lora else {}
    return LLM(model, dtype=dtype or args.dtype, device="cpu", max_num_seqs=max_batch, enable_prefix_caching=False,
               max_num_batched_tokens=max(2048, max_batch * args.context_len),
               max_model_len=args.context_len + args.warm_up_steps + args.steps + 16, **settings)


def row_loras(name: str, batch: int, adapters: list) -> list:
    if name in (NO_LORA, BASE):
        return [None] * batch
    if name == ONE:
        return [adapters[0]] * batch
    return [adapters[i % len(adapters)] for i in range(batch)]


def configurations(batch: int, num_adapters: int) -> list[str]:
    names = [NO_LORA, BASE, ONE]
    return names + [MIXED] if batch >= num_adapters > 1 else names


def decode_rounds(engines: dict, adapters: list, vocab: int, args) -> dict[tuple[str, int], list[float]]:
    """{(configuration, batch): each round's median step ms}, the order rotating round by round; the prompts are
    the same for every configuration and round."""
    prompts = {batch: random_prompts(random.Random(batch), batch, args.context_len, vocab)
               for batch in args.batch_sizes}
    runs: dict[tuple[str, int], list[float]] = {}
    for round_ in range(args.repeat):
        for batch in args.batch_sizes:
            names = configurations(batch, len(adapters))
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                llm = engines[NO_LORA if name == NO_LORA else BASE]
                runs.setdefault((name, batch), []).append(
                    prompts_decode_step_ms(llm, prompts[batch], args.steps, args.warm_up_steps,
                                           row_loras(name, batch, adapters)))
        figures = ", ".join(f"{name} b{batch} {rounds[-1]:.2f} ms" for (name, batch), rounds in runs.items())
        print(f"[round {round_ + 1}/{args.repeat}] {figures}; load {load_average()}", file=sys.stderr)
    return runs


def same_round_ratios(runs: dict, name: str, base: str, batch: int) -> list[float]:
    return [ms / base_ms for ms, base_ms in zip(runs[name, batch], runs[base, batch])]


# --- the LoRA op's share -----------------------------------------------------------------------------------------

def op_share_ms(llm, batch: int, num_adapters: int, repeats: int = 30) -> dict[str, float]:
    """ms per decode step of batch rows, summed over the model's LoRA linears (q/k/v, o, gate/up, down of every
    layer), each called directly on random rows: the base matmul (the platform's linear on the packed weight) and
    the LoRA add (LoRAWeights.add, the platform's lora_add) with every row on no adapter, on slot 0, on slots
    spread (row i on slot i mod num_adapters, as the decode rows above) and on the same slots in runs (rows of
    one slot next to each other: what the engine's row order does not arrange). Median of repeats passes, the
    kinds alternating pass by pass."""
    lora = llm.executor.runner.lora
    layers = list(lora.layers.values())
    dtype = next(iter(layers[0].parts.values())).lora_a.dtype
    xs = [torch.randn(batch, layer.layer.input_size, dtype=dtype) for layer in layers]
    slots = {"LoRA add, base rows": [-1] * batch, "LoRA add, one adapter": [0] * batch,
             "LoRA add, adapters spread": [i % num_adapters for i in range(batch)],
             "LoRA add, adapters in runs": [i * num_adapters // batch for i in range(batch)]}
    times: dict[str, list[float]] = {"base matmuls": [], **{name: [] for name in slots}}
    with torch.inference_mode():
        ys = [layer.layer.linear(x, layer.layer.weight, layer.layer.bias, layer.layer.packed_weight)
              for layer, x in zip(layers, xs)]
        for _ in range(repeats + 2):  # the first two passes warm up
            started = time.perf_counter()
            for layer, x in zip(layers, xs):
                layer.layer.linear(x, layer.layer.weight, layer.layer.bias, layer.layer.packed_weight)
            times["base matmuls"].append(time.perf_counter() - started)
            for name, rows in slots.items():
                lora.rows.set(torch.tensor(rows, dtype=torch.int64))
                started = time.perf_counter()
                for layer, x, y in zip(layers, xs, ys):
                    layer.add(x, y)
                times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values[2:]) * 1e3 for name, values in times.items()}


# --- load --------------------------------------------------------------------------------------------------------

def time_loads(llm, adapter_path: str, first_id: int, args) -> dict:
    """The read (LoRAAdapters._parts_of: read_adapter_weights and the mapping to our layers) and the slot writes
    (LoRAWeights.write_slot on every LoRA layer), each repetition on a fresh adapter id; then the same adapter
    again from the host cache (its writes only)."""
    from tpengine.distributed.messages import LoRALoad

    lora = llm.executor.runner.lora
    read_ms, write_ms, cached_ms = [], [], []
    for i in range(args.load_repeat):
        load = LoRALoad(slot=0, lora_int_id=first_id + i, path=adapter_path)
        started = time.perf_counter()
        parts = lora._parts_of(load)
        read = time.perf_counter()
        for name, layer in lora.layers.items():
            layer.write_slot(load.slot, parts.get(name, {}))
        written = time.perf_counter()
        lora.apply([load])  # from the host cache: what a slot eviction's reload costs
        cached = time.perf_counter()
        read_ms.append((read - started) * 1e3)
        write_ms.append((written - read) * 1e3)
        cached_ms.append((cached - written) * 1e3)
        lora.read.pop(load.lora_int_id, None)
    return dict(layers=len(lora.layers), read_ms=read_ms, write_ms=write_ms,
                total_ms=[r + w for r, w in zip(read_ms, write_ms)], cached_ms=cached_ms)


def first_request_ms(llm, adapter_path: str, first_id: int, vocab: int, args) -> dict[str, list[float]]:
    """llm.generate of one prompt, max_tokens 1, end to end: on a fresh adapter (read from disk and written into a
    slot before the prefill), on the one just loaded (resident), and on no adapter; the three alternate."""
    from tpengine import SamplingParams
    from tpengine.lora.request import LoRARequest

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prompt = random_prompts(random.Random(7), 1, args.first_prompt_len, vocab)
    times: dict[str, list[float]] = {"adapter loaded first": [], "adapter resident": [], "no adapter": []}
    for i in range(args.load_repeat):
        fresh = LoRARequest(f"load-{i}", first_id + i, adapter_path)
        for label, lora in (("adapter loaded first", fresh), ("adapter resident", fresh), ("no adapter", None)):
            started = time.perf_counter()
            llm.generate(prompt, params, use_tqdm=False, lora_request=lora)
            times[label].append((time.perf_counter() - started) * 1e3)
    return times


def load_model_path(args) -> tuple[str, dict]:
    """The 0.6B-shaped model the loads run on (written once into CACHE), or the decode model with --load-layers 0."""
    shape = dict(QWEN3_0_6B, vocab_size=LOAD_VOCAB, num_hidden_layers=args.load_layers)
    path = write_model("cpu", os.path.join(CACHE, f"qwen3_0_6b_shape_{args.load_layers}_layers_vocab_{LOAD_VOCAB}"),
                       shape)
    return path, read_config(path)


# --- main --------------------------------------------------------------------------------------------------------

def main(argv=None) -> None:
    args = parse_args(argv)
    record = Record("bench_lora", argv, machine_line("cpu", torch.get_num_threads()))
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="tpengine-lora-") as tmp:
        if args.model:
            model, label = args.model, f"`{args.model}`"
        elif args.quick:
            model = write_model("cpu", os.path.join(tmp, "model"), QUICK_MODEL)
            label = "random-weight Qwen3 (QUICK_MODEL)"
        else:
            model = write_model("cpu", os.path.join(CACHE, CACHED_MODEL_FOLDERS["small"]), LOW_BATCH_MODEL)
            label = "random-weight Qwen3 (LOW_BATCH_MODEL)"
        config = read_config(model)
        from tpengine.lora.request import LoRARequest
        adapters = [LoRARequest(f"adapter-{i}", i, write_adapter(os.path.join(tmp, f"adapter-{i}"), config, args.rank,
                                                                  seed=i))
                    for i in range(1, args.num_adapters + 1)]
        engines = {NO_LORA: make_engine(model, args, lora=False), BASE: make_engine(model, args, lora=True)}
        try:
            runs = decode_rounds(engines, adapters, config["vocab_size"], args)
            ops = {batch: op_share_ms(engines[BASE], batch, args.num_adapters) for batch in args.batch_sizes}
            if args.load_layers:
                engines[NO_LORA].shutdown()
                engines.pop(NO_LORA)
                load_path, load_config = load_model_path(args)
                load_llm = make_engine(load_path, args, lora=True, max_batch=1, dtype=args.load_dtype)
                engines["load"] = load_llm
            else:
                load_llm, load_config = engines[BASE], config
            load_adapter = write_adapter(os.path.join(tmp, "load-adapter"), load_config, args.rank, seed=99)
            loads = time_loads(load_llm, load_adapter, 1000, args)
            first = first_request_ms(load_llm, load_adapter, 2000, load_config["vocab_size"], args)
        finally:
            for llm in engines.values():
                llm.shutdown()
    report(args, record, label, config, load_config, runs, ops, loads, first, load_before)


def spread(values: list[float], digits: int = 2) -> str:
    cell = f"{statistics.median(values):.{digits}f}"
    return cell + (f" ({min(values):.{digits}f}-{max(values):.{digits}f})" if len(values) > 1 else "")


def report(args, record, label, config, load_config, runs, ops, loads, first, load_before) -> None:
    fields = record.fields
    print(f"{fields['command']}")
    print(f"machine: {fields['machine']}; date {fields['date']}; revision {fields['revision']}; "
          f"load average before {load_before}, after {load_average()}")
    print(f"model: {label}, hidden {config['hidden_size']}, {config['num_hidden_layers']} layers, {args.dtype}; "
          f"{args.num_adapters} adapters of rank {args.rank} on {', '.join(TARGETS)}; context {args.context_len}; "
          f"median of {args.steps} decode steps after {args.warm_up_steps} warm-up, {args.repeat} round(s), "
          f"order rotating; ms: median round (range)")
    print()
    print("| configuration | batch | step ms | vs LoRA on, base rows (same-round median) | vs no LoRA |")
    print("|---|---:|---:|---:|---:|")
    for batch in args.batch_sizes:
        for name in configurations(batch, args.num_adapters):
            shown = name if name != MIXED else f"{args.num_adapters} {name}"
            base = "" if name == NO_LORA else f"{statistics.median(same_round_ratios(runs, name, BASE, batch)):.3f}x"
            vs_none = f"{statistics.median(same_round_ratios(runs, name, NO_LORA, batch)):.3f}x"
            print(f"| {shown} | {batch} | {spread(runs[name, batch])} | {base} | {vs_none} |")
    print()
    print(f"The LoRA op against the base matmuls, per decode step: the {len(next(iter(ops.values())))} kinds summed "
          "over the model's LoRA linears, called directly (ms, median of 30 passes):")
    print()
    kinds = list(next(iter(ops.values())))
    print("| batch | " + " | ".join(kinds) + " |")
    print("|---:|" + "---:|" * len(kinds))
    for batch, by_kind in ops.items():
        print(f"| {batch} | " + " | ".join(f"{by_kind[kind]:.3f}" for kind in kinds) + " |")
    scale = QWEN3_0_6B_LAYERS / load_config["num_hidden_layers"] if args.load_layers else 1.0
    where = (f"Qwen3-0.6B's layer shape, {load_config['num_hidden_layers']} layers"
             + (f", scaled x{scale:.3g} to 28" if scale != 1.0 else "") if args.load_layers
             else f"the decode model ({load_config['num_hidden_layers']} layers, not the 0.6B shape)")
    print()
    slot_dtype = args.load_dtype if args.load_layers else args.dtype
    print(f"Adapter load, rank {args.rank} on all 7 projections, {where}, {slot_dtype} "
          f"slots ({loads['layers']} LoRA layers); ms, median of {args.load_repeat} (range):")
    print()
    print("| part | ms | per layer |")
    print("|---|---:|---:|")
    layers = load_config["num_hidden_layers"]
    for key, part in (("read_ms", "read from disk (read_adapter_weights + mapping)"), ("write_ms", "slot writes"),
                      ("total_ms", "**load (read + writes)**"), ("cached_ms", "reload from the host cache (writes)")):
        values = [v * scale for v in loads[key]]
        print(f"| {part} | {spread(values)} | {statistics.median(loads[key]) / layers:.3f} |")
    print()
    print(f"First request end to end (generate of 1 prompt of {args.first_prompt_len} tokens, max_tokens 1; "
          f"same model; not scaled), ms, median of {args.load_repeat} (range):")
    print()
    print("| request | ms | vs adapter resident |")
    print("|---|---:|---:|")
    resident = statistics.median(first["adapter resident"])
    for name, values in first.items():
        print(f"| {name} | {spread(values)} | {statistics.median(values) - resident:+.2f} ms |")
    print()
    for line in aims(args, runs, [v * scale for v in loads["total_ms"]]):
        print(line)
    record.write(args.json, model=dict(model_fields(_Config(config)), path=label), dtype=args.dtype, rank=args.rank,
                 num_adapters=args.num_adapters, context_len=args.context_len, decode_steps=args.steps,
                 rounds=args.repeat, series=[dict(configuration=name, batch=batch, step_ms=ms)
                                             for (name, batch), ms in runs.items()],
                 load=dict(loads, load_layers=args.load_layers, scale_to_28=scale, load_dtype=args.load_dtype),
                 first_request_ms=first, op_share_ms={str(batch): by_kind for batch, by_kind in ops.items()})


class _Config:
    def __init__(self, config: dict):
        self.__dict__.update(config)


def aims(args, runs: dict, load_ms: list[float]) -> list[str]:
    lines = []
    for batch in args.batch_sizes:
        ratios = same_round_ratios(runs, ONE, BASE, batch)
        lines.append(f"aim: one rank-{args.rank} adapter on every row at batch {batch} <= {ONE_ADAPTER_AIM}x the base "
                     f"step: {'met' if statistics.median(ratios) <= ONE_ADAPTER_AIM else 'NOT met'} "
                     f"({statistics.median(ratios):.3f}x; rounds {min(ratios):.3f}-{max(ratios):.3f}x)")
        if (MIXED, batch) in runs:
            ratios = same_round_ratios(runs, MIXED, BASE, batch)
            lines.append(f"aim: {args.num_adapters} adapters spread over batch {batch} <= {MIXED_AIM}x the base step: "
                         f"{'met' if statistics.median(ratios) <= MIXED_AIM else 'NOT met'} "
                         f"({statistics.median(ratios):.3f}x; rounds {min(ratios):.3f}-{max(ratios):.3f}x)")
    median = statistics.median(load_ms)
    shape = "the 0.6B shape" if args.load_layers else "the decode model (not the 0.6B shape)"
    lines.append(f"aim: a rank-{args.rank} load on {shape} < {LOAD_AIM_MS:.0f} ms: "
                 f"{'met' if median < LOAD_AIM_MS else 'NOT met'} ({median:.1f} ms)")
    return lines


if __name__ == "__main__":
    main()
