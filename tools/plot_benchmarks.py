"""Plots for docs/benchmarks.md from the benchmarks' --json output (matplotlib, Agg backend: no display needed).

From benchmarks/bench_low_batch.py's JSON (one file per dtype, say; every file given is read):

- decode-throughput-by-batch.png: decode tok/s against batch size for every engine the runs timed (tpengine,
  transformers generate, llama.cpp, vLLM), the median round as the line and the rounds' range as a band;
- decode-step-vs-floor.png: tpengine's decode step (ms) against batch size, with the weight-read floor measured
  in the same run and that floor plus the KV cache a step reads, at the floor's bandwidth.

    .venv/bin/python tools/plot_benchmarks.py docs/bench-data/low_batch_float32.json [more.json] --out-dir docs
    .venv/bin/python tools/plot_benchmarks.py --quick     # seconds: plots a bench_low_batch --quick run's JSON

--quick runs benchmarks/bench_low_batch.py --quick --transformers --json into a temporary folder and plots that
into --out-dir (default: the same temporary folder, which it prints and keeps).
"""
import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile

from tpengine.bench.quick import parse_with_quick

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
THROUGHPUT_PNG = "decode-throughput-by-batch.png"
FLOOR_PNG = "decode-step-vs-floor.png"
# one colour per engine, so llama.cpp's variants share a hue family and tpengine stands out
COLOURS = {"tpengine": ["#d62728", "#ff7f0e"], "llama.cpp": ["#1f77b4", "#17becf", "#9edae5"],
           "vLLM": ["#2ca02c"], "transformers": ["#7f7f7f"]}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("inputs", nargs="*", help="bench_low_batch.py --json files")
    p.add_argument("--out-dir", help="where the PNGs go (default: docs/, or the --quick run's folder)")
    args = parse_with_quick(p, argv, {}, "runs bench_low_batch.py --quick --transformers --json and plots its file")
    if not args.inputs and not args.quick:
        p.error("give bench_low_batch.py --json files, or --quick")
    return args


def load(paths: list[str]) -> list[dict]:
    records = []
    for path in paths:
        with open(path) as f:
            record = json.load(f)
        if record.get("benchmark") != "bench_low_batch":
            raise SystemExit(f"{path}: not a bench_low_batch.py --json file")
        records.append(record)
    return records


def model_title(record: dict) -> str:
    m = record["model"]
    return (f"random-weight Qwen3, hidden {m['hidden_size']}, {m['num_hidden_layers']} layers, "
            f"{m['params'] / 1e6:,.0f}M params, context {record['context_len']}")


def machine_title(record: dict) -> str:
    """The CPU and core count from the record's machine line, and the date."""
    cpu, _, rest = record["machine"].partition(";")
    cores = next((part.split("=")[1].split(",")[0] for part in rest.split() if part.startswith("os.cpu_count()=")), "?")
    return f"{cpu.strip()}, {cores} cores; {record['date'].split()[0]}, {record['revision'].split()[0]}"


def curves(records: list[dict]) -> dict[str, dict[int, list[float]]]:
    """Decode tok/s of every round, by series label and batch, over all records (a label seen twice merges)."""
    result = collections.defaultdict(lambda: collections.defaultdict(list))
    for record in records:
        for point in record["series"]:
            # a difference of two timings (the baselines') can come out <= 0 in a --quick run: nothing to plot
            result[point["label"]][point["batch"]] += [point["batch"] / ms * 1e3 for ms in point["step_ms"] if ms > 0]
    for by_batch in result.values():
        for batch in [b for b, rates in by_batch.items() if not rates]:
            del by_batch[batch]
    return result


def colour(label: str, used: dict[str, int]) -> str:
    engine = label.split(" ")[0]
    palette = COLOURS.get(engine, ["#9467bd", "#8c564b", "#e377c2"])
    index = used[engine] = used.get(engine, -1) + 1
    return palette[index % len(palette)]


def log_axes(ax, records: list[dict]) -> None:
    """Batch sizes as a log-2 x axis with every measured batch a tick; a log y axis labelled in plain numbers."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    batches = sorted({p["batch"] for r in records for p in r["series"]})
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:,.0f}" if y >= 10 else f"{y:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.grid(True, which="major", alpha=0.35)
    ax.grid(True, which="minor", alpha=0.12)


def plot_throughput(plt, records: list[dict], path: str) -> None:
    fig, ax = plt.subplots(figsize=(8, 5.2), dpi=110)
    used = {}
    for label, by_batch in sorted(curves(records).items(), key=lambda item: (not item[0].startswith("tpengine"), item[0])):
        batches = sorted(by_batch)
        median = [statistics.median(by_batch[b]) for b in batches]
        c = colour(label, used)
        width = 2.4 if label.startswith("tpengine") else 1.6
        ax.plot(batches, median, marker="o", linewidth=width, color=c, label=label)
        if any(len(by_batch[b]) > 1 for b in batches):
            ax.fill_between(batches, [min(by_batch[b]) for b in batches], [max(by_batch[b]) for b in batches],
                            color=c, alpha=0.15, linewidth=0)
    log_axes(ax, records)
    ax.set_xlabel("batch size (sequences decoding together)")
    ax.set_ylabel("decode throughput (output tokens/s, log scale)")
    first = records[0]
    rounds = max(r["rounds"] for r in records)
    ax.set_title(f"Decode throughput by batch size (median of {rounds} round{'s' if rounds > 1 else ''}, band: range)\n"
                 f"{model_title(first)}\n{machine_title(first)}", fontsize=9.5)
    ax.legend(fontsize=8.5, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_floor(plt, records: list[dict], path: str) -> None:
    fig, ax = plt.subplots(figsize=(8, 5.2), dpi=110)
    used = {}
    for record in records:
        ours = [p for p in record["series"] if p["label"].startswith("tpengine")]
        if not ours:
            continue
        batches = sorted(p["batch"] for p in ours)
        by_batch = {p["batch"]: p["step_ms"] for p in ours}
        label = ours[0]["label"]
        c = colour(label, used)
        ax.plot(batches, [statistics.median(by_batch[b]) for b in batches], marker="o", linewidth=2.4, color=c,
                label=f"{label}: decode step")
        if record["rounds"] > 1:
            ax.fill_between(batches, [min(by_batch[b]) for b in batches], [max(by_batch[b]) for b in batches],
                            color=c, alpha=0.15, linewidth=0)
        floor = min(record["floor_ms"])
        gb_s = record["weight_bytes"] / floor / 1e6
        ax.plot(batches, [floor] * len(batches), linestyle="--", color=c, linewidth=1.4,
                label=f"weight-read floor, {record['dtype']}: {record['weight_bytes'] / 1e6:,.1f} MB at {gb_s:,.{0 if gb_s >= 10 else 1}f} GB/s")
        context = record["context_len"] + record["decode_steps"] / 2  # the mean context over the timed steps
        kv = [floor * (record["weight_bytes"] + b * context * record["kv_bytes_per_token"]) / record["weight_bytes"]
              for b in batches]
        ax.plot(batches, kv, linestyle=":", color=c, linewidth=1.4,
                label=f"weights + KV cache read at that speed ({record['dtype']})")
    log_axes(ax, records)
    ax.set_xlabel("batch size (sequences decoding together)")
    ax.set_ylabel("time per decode step (ms, log scale)")
    first = records[0]
    ax.set_title(f"tpengine's decode step against the weight-read floor\n{model_title(first)}\n"
                 f"{machine_title(first)}", fontsize=9.5)
    ax.legend(fontsize=8.5, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> None:
    args = parse_args(argv)
    inputs, out_dir = list(args.inputs), args.out_dir
    if args.quick and not inputs:
        if out_dir:
            scratch = tempfile.TemporaryDirectory(prefix="tpengine-plots-")  # the JSON goes when the script ends
            folder = scratch.name
        else:
            folder = tempfile.mkdtemp(prefix="tpengine-plots-")  # it holds the plots too: kept
        inputs = [os.path.join(folder, "low_batch_quick.json")]
        subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_low_batch.py"), "--quick", "--transformers",
                        "--json", inputs[0]], check=True, stdout=subprocess.DEVNULL)
        out_dir = out_dir or folder
    out_dir = out_dir or DOCS
    os.makedirs(out_dir, exist_ok=True)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = load(inputs)
    for name, plot in ((THROUGHPUT_PNG, plot_throughput), (FLOOR_PNG, plot_floor)):
        path = os.path.join(out_dir, name)
        plot(plt, records, path)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
