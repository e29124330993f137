"""The CPU's quantized linear (kernels/cpu/quant_linear.cpp) against an earlier revision's, in one process, alternating.

The earlier kernel is the file at --baseline (default HEAD~1), or --baseline-source FILE, built beside this one under
another op namespace (benchmarks/kernel_baseline.py). Both multiply the same packed weights: the linears of --layers
decoder layers of Qwen3-0.6B's shape (qkv 4096x1024, o 1024x2048, gate_up 6144x1024, down 1024x3072), passed in
order as a forward does, so the weights come from memory. For each weight format (int8 per output channel, int4 in
groups of 128), activation (int8: quantized per row on the fly; float: GPTQ/AWQ's) and row count: the median ms of
one pass over every layer, for each kernel, over --rounds alternating rounds; the weight bytes read a second (GB/s); the
ratio; and the largest difference between the two kernels' outputs (0 unless the arithmetic changed).

    .venv/bin/python benchmarks/bench_quant_linear.py [--baseline REV | --baseline-source FILE] [--rows 1 4 16]
    .venv/bin/python benchmarks/bench_quant_linear.py --quick    # seconds: QUICK_MODEL's shapes, 2 layers, 2 rounds
"""
import argparse
import statistics
import tempfile
import time

import torch

from kernel_baseline import load_baseline  # benchmarks/, this script's folder
from tpengine.bench.models import QUICK_MODEL
from tpengine.bench.quick import parse_with_quick
from tpengine.kernels.cpu import quant_linear as cpu_quant
from tpengine.quantization.online import quantize_weight

SOURCE = "kernels/cpu/quant_linear.cpp"
QWEN3_0_6B = dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128)
FORMATS = {"int8": (8, None), "int4": (4, 128)}  # bits, group size (None: one scale per output channel)


def layer_shapes(model: dict) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's linears: qkv, o, gate_up, down."""
    hidden, head_dim = model["hidden_size"], model["head_dim"]
    q, kv = model["num_attention_heads"] * head_dim, model["num_key_value_heads"] * head_dim
    return [(q + 2 * kv, hidden), (hidden, q), (2 * model["intermediate_size"], hidden),
            (hidden, model["intermediate_size"])]


def pass_over(op, packs, inputs) -> list[torch.Tensor]:
    return [op(inputs[p.in_features], p.weight, p.scales, p.zeros, p.out_features, p.in_features, p.bits,
               p.group_columns, p.activation == "int8", p.correct_zeros, None) for p in packs]


def compare(args, model: dict, fmt: str, activation: str, rows: int) -> str:
    bits, group_size = FORMATS[fmt]
    generator = torch.Generator().manual_seed(0)
    packs = []
    for _ in range(args.layers):
        for out_features, in_features in layer_shapes(model):
            w = quantize_weight(torch.randn(out_features, in_features, generator=generator) * 0.02, bits,
                                min(group_size or in_features, in_features), activation)
            packs.append(cpu_quant.pack(w.qweight, w.scales, w.zeros, w.bits, w.group_size, activation))
    inputs = {i: torch.randn(rows, i, generator=generator) for _, i in layer_shapes(model)}
    ops = {"baseline": torch.ops.tpengine_baseline.quant_linear, "this": torch.ops.tpengine_cpu.quant_linear}
    difference = max((a - b).abs().max().item()
                     for a, b in zip(pass_over(ops["baseline"], packs, inputs), pass_over(ops["this"], packs, inputs)))
    ms = {name: [] for name in ops}
    for round_ in range(args.rounds):
        for name, op in list(ops.items())[::-1 if round_ % 2 else 1]:  # either kernel first in turn
            start = time.perf_counter()
            pass_over(op, packs, inputs)
            ms[name].append((time.perf_counter() - start) * 1e3)
    base, this = statistics.median(ms["baseline"]), statistics.median(ms["this"])
    weight_bytes = sum(p.weight.numel() + p.scales.numel() * 4 + p.zeros.numel() for p in packs)
    return (f"| {fmt} | {activation} | {rows} | {base:.2f} ({weight_bytes / base / 1e6:.1f}) | "
            f"{this:.2f} ({weight_bytes / this / 1e6:.1f}) | {base / this:.2f}x | {difference:.3g} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", default="HEAD~1", help="the git revision whose kernel is the baseline")
    p.add_argument("--baseline-source", help="a file with the baseline kernel's source instead")
    p.add_argument("--formats", nargs="+", choices=tuple(FORMATS), default=list(FORMATS))
    p.add_argument("--activations", nargs="+", choices=cpu_quant.ACTIVATIONS, default=list(cpu_quant.ACTIVATIONS))
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16], help="rows of x (tokens) per call")
    p.add_argument("--layers", type=int, default=28, help="decoder layers whose linears are passed in turn")
    p.add_argument("--rounds", type=int, default=7)
    args = parse_with_quick(p, argv, dict(rows=[1, 2], layers=2, rounds=2), "QUICK_MODEL's shapes")
    if min(args.rows + [args.layers, args.rounds]) < 1:
        p.error("rows, layers and rounds must be >= 1")
    if not cpu_quant.available():
        print("the quantized linear does not build here: nothing to compare")
        return
    model = QUICK_MODEL if args.quick else QWEN3_0_6B
    with tempfile.TemporaryDirectory(prefix="bench_quant_linear_") as folder:
        load_baseline(SOURCE, args.baseline, args.baseline_source, folder, cpu_quant.EXTRA_FLAGS)
        print(f"baseline: {args.baseline_source or args.baseline}; {args.layers} layers of "
              f"{'QUICK_MODEL' if args.quick else 'Qwen3-0.6B'}'s linears; median of {args.rounds} alternating rounds; "
              f"torch threads {torch.get_num_threads()}")
        print("| weights | activations | rows | baseline ms (GB/s) | this kernel ms (GB/s) | speed-up "
              "| largest difference |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for fmt in args.formats:
            for activation in args.activations:
                for rows in args.rows:
                    print(compare(args, model, fmt, activation, rows), flush=True)


if __name__ == "__main__":
    main()
