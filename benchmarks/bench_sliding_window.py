"""Sliding-window attention on the CPU (issue 29): decode at a long context with a window, with and without the
ledger giving back the blocks behind it, against the same model attending to the whole context, in one run.

Model (random weights, written once and cached in ~/.cache/tpengine-bench/, or --model): a Mistral of vocab
4096, hidden 256, 4 layers, 4 heads of 64 (2 KV heads), written by transformers with sliding_window=--window
in every layer and max_position_embeddings past --context-len. The full-attention baseline is the same folder's
weights with sliding_window null (a second folder: config.json changed, the safetensors linked).

Each configuration gets its own engine (tp 1, the auto backend, float32, prefix caching off, block size
--block-size, max_num_batched_tokens --chunk) and one greedy request of --context-len random prompt tokens that
writes --output-len tokens after its first (ignore_eos). The prompt prefills in chunks (untimed, but its
seconds are printed); then each llm.step() until the request finishes is timed: decode tok/s = tokens written
after the first / those steps' seconds. Held blocks: the blocks the sequence holds at its last step (its table
less the released entries), and the cache's peak usage over the decode, in blocks and MiB of K/V.

Every round runs every configuration, the order rotating round by round (--repeat); each keeps its fastest decode.

Configurations:
- window, released: the engine as shipped (every layer slides, so the ledger releases blocks behind the window);
- window, kept: the same engine with its ledger's release switched off (block_manager.sliding_window = None
  before the request: a stand-in for an engine without release; attention still reads only the window);
- full attention: the baseline checkpoint, every layer reading the whole context.

    .venv/bin/python benchmarks/bench_sliding_window.py               # 32k context, window 4k
    .venv/bin/python benchmarks/bench_sliding_window.py --quick       # 256 tokens, window 64, in seconds
"""
import argparse
import json
import os
import random
import time

from tpengine.bench.results import Record, add_json_flag
from tpengine import LLM, SamplingParams
from tpengine.cache import cache_dir
from tpengine.paging import blocks_for
from tpengine.tiny_model import write_tiny_model

MODEL = dict(architecture="MistralForCausalLM", vocab_size=4096, hidden_size=256, intermediate_size=512,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64, initializer_range=0.05)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context-len", type=int, default=32768)
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens: the prompt's chunk size")
    parser.add_argument("--model", help="a Mistral checkpoint with the window (its full-attention copy is made)")
    parser.add_argument("--repeat", type=int, default=2, help="rounds; each figure keeps its best")
    parser.add_argument("--quick", action="store_true", help="256-token context, window 64, 8 tokens, 1 round")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.context_len, args.window, args.output_len, args.repeat = 256, 64, 8, 1
    return args


def checkpoints(args) -> tuple[str, str]:
    """(the windowed checkpoint, its full-attention copy)."""
    max_positions = args.context_len + args.output_len + 64
    window_path = args.model or os.path.join(cache_dir("tpengine-bench"),
                                             f"sliding_window_{args.window}_{max_positions}")
    if not os.path.isdir(window_path):
        write_tiny_model(window_path, seed=29, with_tokenizer=False, sliding_window=args.window,
                         max_position_embeddings=max_positions, **MODEL)
    full_path = window_path.rstrip("/") + "_full_attention"
    if not os.path.isdir(full_path):
        os.makedirs(full_path)
        for name in os.listdir(window_path):
            if name != "config.json":
                os.symlink(os.path.join(os.path.abspath(window_path), name), os.path.join(full_path, name))
        with open(os.path.join(window_path, "config.json")) as f:
            config = json.load(f)
        config["sliding_window"] = None
        with open(os.path.join(full_path, "config.json"), "w") as f:
            json.dump(config, f, indent=1)
    return window_path, full_path


def run(path: str, args, prompt: list[int], release: bool) -> dict:
    with LLM(path, kvcache_block_size=args.block_size, max_num_batched_tokens=args.chunk, enable_prefix_caching=False,
             max_model_len=args.context_len + args.output_len + 1, dtype="float32") as llm:
        block_manager = llm.scheduler.block_manager
        if not release:
            block_manager.sliding_window = None
        llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=args.output_len + 1, ignore_eos=True))
        seq = llm.scheduler.waiting[0]
        start = time.perf_counter()
        while seq.num_tokens == len(prompt):  # the prompt's chunks, then its first token
            llm.step()
        prefill_s = time.perf_counter() - start
        most_used, decode_s = 0, 0.0
        written = seq.num_tokens
        while not llm.scheduler.is_finished():
            held = sum(1 for block_id in seq.block_table if block_id != -1)
            start = time.perf_counter()
            llm.step()
            decode_s += time.perf_counter() - start
            most_used = max(most_used, len(block_manager.used_block_ids))
    tokens = seq.num_tokens - written
    return dict(prefill_s=prefill_s, decode_tok_s=tokens / decode_s, held_blocks=held, peak_blocks=most_used,
                tokens=seq.token_ids[len(prompt):])


def kv_block_bytes(args) -> int:
    """K and V of one block of every layer, float32."""
    return 2 * MODEL["num_hidden_layers"] * args.block_size * MODEL["num_key_value_heads"] * MODEL["head_dim"] * 4


def main(argv=None) -> None:
    args = parse_args(argv)
    record = Record("sliding_window", argv)
    window_path, full_path = checkpoints(args)
    prompt = random.Random(0).choices(range(MODEL["vocab_size"]), k=args.context_len)
    configurations = [("window, released", window_path, True), ("window, kept", window_path, False),
                      ("full attention", full_path, True)]
    best = {}
    for round_ in range(args.repeat):  # the order rotates round by round; each keeps its fastest decode
        for name, path, release in configurations[round_ % 3:] + configurations[:round_ % 3]:
            row = run(path, args, prompt, release)
            if name not in best or row["decode_tok_s"] > best[name]["decode_tok_s"]:
                best[name] = row
    rows = [(name, best[name]) for name, _, _ in configurations]
    block_mib = kv_block_bytes(args) / 2**20
    baseline = rows[-1][1]["decode_tok_s"]
    print(f"context {args.context_len} tokens (+{args.output_len} written), window {args.window}, "
          f"blocks of {args.block_size} ({blocks_for(args.context_len + args.output_len, args.block_size)} for the "
          f"whole sequence), {block_mib * 1024:.0f} KiB of K/V per block")
    print("| configuration | prefill s | decode tok/s | vs full attention | blocks held at the end | "
          "peak blocks in use | peak K/V MiB |")
    print("|---|---|---|---|---|---|---|")
    for name, row in rows:
        print(f"| {name} | {row['prefill_s']:.1f} | {row['decode_tok_s']:.1f} | {row['decode_tok_s'] / baseline:.2f}x "
              f"| {row['held_blocks']} | {row['peak_blocks']} | {row['peak_blocks'] * block_mib:.1f} |")
    same = rows[0][1]["tokens"] == rows[1][1]["tokens"]
    print(f"released and kept write the same tokens: {same}")
    record.write(args.json, context_len=args.context_len, window=args.window, output_len=args.output_len,
                 block_size=args.block_size, rows={name: {k: v for k, v in row.items() if k != "tokens"}
                                                   for name, row in rows}, same_tokens=same)


if __name__ == "__main__":
    main()
