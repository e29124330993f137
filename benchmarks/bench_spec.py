"""Speculative decoding on the CPU (issue 28): decode tok/s at batch 1, 4 and 16 with and without speculation, in
one run, with acceptance rates, and what one verify forward costs against a plain decode step.

Models (random weights, written once and cached in ~/.cache/tpengine-bench/, or --model):
- target: tpengine.bench's LOW_BATCH_MODEL (vocab 8192, hidden 512, 6 layers, untied head; ~23M params),
  the same folder bench_low_batch.py and bench_quant.py use; --quick: QUICK_MODEL.
- draft (for the draft-model rows): the target cut to its first --draft-layers decoder layers, with the
  target's own embedding, final norm and LM head (safetensors + config.json with num_hidden_layers N, the
  target's tokenizer and generation files copied): a layer-skipped self-draft. On random weights every layer
  moves the argmax a long way, so it agrees with the target on almost no token (0% with 1 or 2 of
  LOW_BATCH_MODEL's 6 layers; the run prints it: teacher-forced top-1 agreement on the target's greedy
  continuations, through transformers).
  --damp-skipped-layers S runs the draft rows against a copy of the target whose layers past the draft's
  have o_proj and down_proj scaled by S (same shapes, so the same cost per step): at S=0.03 those layers
  barely move the residual stream and the draft agrees on 82-86% of tokens, a stand-in for a well-matched
  trained draft. Those rows then get a plain baseline of their own, on that copy.

Workloads, greedy, ignore_eos, max(batch sizes) prompts of --context-len tokens each (the same for every batch
size and every round), each writing --output-len tokens after its first (max_tokens = output_len + 1):
- repeat: each prompt a random segment of --segment-len tokens repeated. A random-weight model does not copy
  it (no induction heads), but such a prompt throws its greedy output into runs of one or two tokens, and
  its text falls into loops anyway: the n-gram proposer's home ground, where acceptance is high.
- random: random prompts; acceptance is whatever the loops the model falls into give.

Decode throughput: one engine per configuration (plain; n-gram with --num-spec-tokens k and
--prompt-lookup-min/max; the draft model), each made once, prefix caching off (so a repeat computes
everything), max_num_batched_tokens large enough that a batch's prompts prefill in one step. At batch b the
workload's prompts run in groups of b, one group after the other (so every batch size decodes the same
prompts, and batch 1 is not one prompt's luck): a group's requests are queued, one llm.step() runs their
prefill (untimed; it gives each sequence its first token), then the wall time of llm.step() until the group
finishes is its decode time; decode tok/s = tokens written after the prefills / the groups' decode time.
Speculation may finish some sequences of a group early, and the batch then runs smaller: that is what a
generate() of the group gets. Where a draft model prefills the prompts lazily in its first proposal, that
prefill falls inside the window. Acceptance comes from llm.spec_decode_stats over the timed steps:
acceptance = accepted drafts / drafts, and accepted drafts per verify row (a verify row writes that + 1
tokens). Every round runs every configuration on every (workload, batch), the order rotating round by
round (--repeat); each figure keeps its best round, and each speed-up is also given as the median over rounds
of the ratio within a round (the batch-16 aim is judged on it: on a machine whose speed drifts by 10-30%
from round to round, two configurations' best rounds need not be the same round's luck). Speculation must
not change a greedy token: the
"same tokens" column compares each run's outputs with the plain run's at the same batch.

Verify cost: through the plain engine's model runner (tp 1), for each batch size, `batch` sequences whose
--context-len tokens are prefilled once; then, alternating, a plain decode step (one row each, at position
context_len) and a verify step (k + 1 rows each, the sequence's token and k drafts, at positions context_len
onwards): each rewrites the same KV slots, so every repetition runs at the very same context. runner.execute
is timed whole (inputs, forward, LM head, greedy sampling), median of --verify-steps after 3 warm-up steps;
the round with the fastest plain step is kept. (The CPU pads a forward's rows to a bucket, platforms/cpu.py: up
to 8 rows exactly, so a batch-1 verify row of 5 tokens runs as 5 rows; 80 rows at batch 16 run as 96.)

Whole generate: each round also times one llm.generate() of each workload's prompts all at once (prefill
included) on every engine: the batch as a user runs it, long enough for the draft policy (engine/draft_policy.py)
to settle after the batch sizes before it taught it otherwise; the speed-up is against the engine's plain baseline.

Aims (issue 28), each printed met or not with its numbers: n-gram at batch 1 at least 2x plain decode where
acceptance is high (the repeat workload); a verify forward of k + 1 = 5 tokens at batch 1 at most 1.3x a
plain decode step; at batch 16 speculation never worse than plain by more than 5% (every workload, every
proposer measured).

The draft-model rows need the engine's draft proposer (speculative_config={"model": DRAFT, ...}); an
engine that refuses it (ValueError) gets a line saying the rows were skipped and why, and the rest runs.

    .venv/bin/python benchmarks/bench_spec.py                              # 4.5 minutes on 2 shared cores
    .venv/bin/python benchmarks/bench_spec.py --repeat 5 --json /tmp/spec.json
    .venv/bin/python benchmarks/bench_spec.py --draft-layers 2 --damp-skipped-layers 0.03
    .venv/bin/python benchmarks/bench_spec.py --quick                      # seconds: QUICK_MODEL
"""
import argparse
import json
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time

import torch

from tpengine.bench.models import (CACHE, CACHED_MODEL_FOLDERS, LOW_BATCH_MODEL, QUICK_MODEL, model_fields, num_params,
                                   write_model)
from tpengine.bench.quick import parse_with_quick
from tpengine.bench.results import Record, add_json_flag, load_average, machine_line
from tpengine.bench.workload import random_prompts
from tpengine.tiny_model import write_layer_draft

WORKLOADS = ("repeat", "random")
PLAIN, NGRAM, DRAFT = "plain", "n-gram", "draft model"
NGRAM_BATCH1_AIM = 2.0   # n-gram at batch 1 over plain, where acceptance is high
VERIFY_COST_AIM = 1.3    # a verify step of k + 1 = 5 tokens at batch 1 over a plain decode step
LARGE_BATCH_LOSS_AIM = 0.95  # speculation at batch 16 over plain: never below this
LARGE_BATCH = 16


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a checkpoint folder instead of the random LOW_BATCH_MODEL")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16], help="decode batches timed")
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--context-len", type=int, default=208, help="prompt tokens per sequence")
    p.add_argument("--segment-len", type=int, default=8, help="the repeat workload's repeated segment")
    p.add_argument("--output-len", type=int, default=64, help="tokens each sequence writes after its first")
    p.add_argument("--num-spec-tokens", type=int, default=4, help="k: drafts per verify row at most")
    p.add_argument("--prompt-lookup-min", type=int, default=2, help="n-gram: shortest suffix looked up")
    p.add_argument("--prompt-lookup-max", type=int, default=4, help="n-gram: longest suffix looked up")
    p.add_argument("--draft-layers", type=int, default=1, help="decoder layers of the self-draft (the target's first)")
    p.add_argument("--damp-skipped-layers", type=float, default=1.0, metavar="S",
                   help="run the draft rows against a copy of the target whose layers past the draft's write S "
                        "times as much (o_proj, down_proj); 1: the target as it is")
    p.add_argument("--no-draft", action="store_true", help="skip the draft-model rows and the draft checkpoint")
    p.add_argument("--verify-steps", type=int, default=30, help="timed steps of each kind in the verify-cost table")
    p.add_argument("--repeat", type=int, default=3, help="rounds, the configurations' order rotating; best kept")
    add_json_flag(p)
    args = parse_with_quick(p, argv, dict(batch_sizes=[1, 2], context_len=24, segment_len=4, output_len=8,
                                          verify_steps=3, repeat=1), "tpengine.bench's QUICK_MODEL")
    if min(args.batch_sizes + [args.context_len, args.segment_len, args.output_len, args.num_spec_tokens,
                               args.prompt_lookup_min, args.draft_layers, args.verify_steps, args.repeat]) < 1:
        p.error("sizes and counts must be >= 1")
    if args.prompt_lookup_min > args.prompt_lookup_max:
        p.error("--prompt-lookup-min is more than --prompt-lookup-max")
    if args.damp_skipped_layers <= 0:
        p.error("--damp-skipped-layers must be > 0")
    return args


# --- checkpoints ----------------------------------------------------------------------------------

LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.")
WEIGHT_FILES = (".safetensors", ".safetensors.index.json", ".gguf", ".bin", ".pt", ".pth")


def load_tensors(model_path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for name in sorted(os.listdir(model_path)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(model_path, name)))
    return tensors


def save_checkpoint(folder: str, tensors: dict[str, torch.Tensor], config: dict, source: str) -> str:
    """tensors as one safetensors file, config.json written last (its presence says the folder is whole), and
    source's other small files (generation config, tokenizer) copied."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    for name in os.listdir(source):
        path = os.path.join(source, name)
        if os.path.isfile(path) and name != "config.json" and not name.endswith(WEIGHT_FILES):
            shutil.copy(path, folder)
    save_file({key: t.contiguous() for key, t in tensors.items()}, os.path.join(folder, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return folder


def read_config(model_path: str) -> dict:
    with open(os.path.join(model_path, "config.json")) as f:
        return json.load(f)


def write_draft(target: str, folder: str, num_layers: int) -> str:
    """The target's first num_layers decoder layers with its embedding, final norm and LM head, in folder
    (tpengine.tiny_model.write_layer_draft; kept there: a folder with config.json is taken as written)."""
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    num_target_layers = read_config(target)["num_hidden_layers"]
    if num_layers >= num_target_layers:
        raise SystemExit(f"--draft-layers {num_layers}: the target has only {num_target_layers} layers")
    print(f"wrote the {num_layers}-layer self-draft to {folder}", file=sys.stderr)
    return write_layer_draft(target, folder, num_layers)


def write_damped_target(target: str, folder: str, num_layers: int, scale: float) -> str:
    """A copy of the target whose layers from num_layers on have their residual writes (o_proj, down_proj)
    scaled by `scale`: the same shapes and cost, the draft's argmax mostly the target's."""
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    config = read_config(target)
    if "quantization_config" in config:
        raise SystemExit("--damp-skipped-layers scales float weights: the target is quantized")
    tensors = load_tensors(target)
    for key, t in tensors.items():
        m = LAYER_KEY.match(key)
        if m and int(m[1]) >= num_layers and (".self_attn.o_proj." in key or ".mlp.down_proj." in key):
            tensors[key] = t * scale
    print(f"wrote the target with layers {num_layers}+ damped by {scale} to {folder}", file=sys.stderr)
    return save_checkpoint(folder, tensors, config, target)


def draft_agreement(target: str, draft: str, prompts: dict[str, list[list[int]]], output_len: int) -> dict[str, float]:
    """Teacher-forced top-1 agreement, per workload: over the target's greedy continuation of each prompt
    (output_len tokens), the fraction of positions where the draft's greedy next token is the target's
    (transformers, float32)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    target_model, draft_model = (AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
                                 for path in (target, draft))
    agreement = {}
    with torch.inference_mode():
        for workload, batch_prompts in prompts.items():
            ids = torch.tensor(batch_prompts)
            sequences = target_model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len,
                                              do_sample=False, eos_token_id=None, pad_token_id=0)
            target_tokens, draft_tokens = (model(sequences).logits[:, ids.size(1) - 1:-1].argmax(-1)
                                           for model in (target_model, draft_model))
            agreement[workload] = (target_tokens == draft_tokens).float().mean().item()
    return agreement


# --- workloads and engines ------------------------------------------------------------------------

def workload_prompts(workload: str, args, vocab: int) -> list[list[int]]:
    """The workload's max(batch sizes) prompts, the same for every batch size and every round."""
    rng = random.Random(WORKLOADS.index(workload))
    num_prompts = max(args.batch_sizes)
    if workload == "random":
        return random_prompts(rng, num_prompts, args.context_len, vocab)
    segments = random_prompts(rng, num_prompts, args.segment_len, vocab)
    return [(segment * -(-args.context_len // args.segment_len))[:args.context_len] for segment in segments]


def spec_configs(args, draft: str | None) -> dict[str, dict]:
    configs = {NGRAM: {"method": "ngram", "num_speculative_tokens": args.num_spec_tokens,
                       "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max}}
    if draft is not None:
        configs[DRAFT] = {"model": draft, "num_speculative_tokens": args.num_spec_tokens}
    return configs


def make_engine(model: str, args, speculative_config: dict | None = None):
    from tpengine import LLM

    max_batch = max(args.batch_sizes)
    llm = LLM(model, dtype=args.dtype, device="cpu", max_num_seqs=max_batch, enable_prefix_caching=False,
              max_num_batched_tokens=max(2048, max_batch * args.context_len),  # every prompt in one prefill step
              max_model_len=args.context_len + args.output_len + args.num_spec_tokens + 8,
              speculative_config=speculative_config)
    warm = random_prompts(random.Random(99), 2, min(args.context_len, 16), llm.vocab_size)
    decode(llm, warm, len(warm), 4)
    return llm


def decode(llm, prompts: list[list[int]], batch: int, output_len: int) -> dict:
    """The prompts in groups of `batch`, one after the other: each group's requests are queued, their prefill
    runs (one step, untimed), then llm.step() is timed until they all finish. Returns the groups' seconds, the
    tokens written after the prefills, the steps, the spec-decode counters' change over the timed steps and
    every sequence's output tokens."""
    from tpengine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len + 1, ignore_eos=True)
    run = dict(seconds=0.0, tokens=0, steps=0, stats=None, token_ids=[])
    for start in range(0, len(prompts), batch):
        group = prompts[start:start + batch]
        ids = [llm.add_request(prompt, params, stream=False) for prompt in group]
        tokens_before = llm.generation_tokens_total
        outputs = {out.request_id: out for out in llm.step()}
        assert not llm.scheduler.waiting and llm.generation_tokens_total - tokens_before == len(group), \
            "the prefill took more than one step"
        tokens_before, stats_before = llm.generation_tokens_total, llm.spec_decode_stats
        started = time.perf_counter()
        while llm.has_unfinished_requests():
            outputs.update((out.request_id, out) for out in llm.step())
            run["steps"] += 1
        run["seconds"] += time.perf_counter() - started
        run["tokens"] += llm.generation_tokens_total - tokens_before
        if stats_before is not None:
            stats = llm.spec_decode_stats
            total = run["stats"] or {key: [0] * len(value) if isinstance(value, list) else 0
                                     for key, value in stats.items()}
            run["stats"] = {key: [t + a - b for t, a, b in zip(total[key], value, stats_before[key])]
                            if isinstance(value, list) else total[key] + value - stats_before[key]
                            for key, value in stats.items()}
        run["token_ids"] += [outputs[i].outputs[0].token_ids for i in ids]
    assert all(len(t) == output_len + 1 for t in run["token_ids"]), "the engine wrote other lengths than asked"
    return run


def generate_seconds(llm, prompts: list[list[int]], output_len: int) -> float:
    """Wall time of one llm.generate() of every prompt at once (prefill included): what a user of a batch
    sees, over long enough for the draft policy to settle whatever the batch before taught it."""
    from tpengine import SamplingParams

    started = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=output_len + 1, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - started


# --- verify cost ----------------------------------------------------------------------------------

def verify_cost_ms(llm, batch: int, args) -> tuple[float, float]:
    """Median ms of runner.execute of a plain decode step of `batch` sequences at context args.context_len, and
    of a verify step of the same sequences with k drafts each, alternating; both rewrite the same KV slots."""
    from tpengine.distributed.messages import BlockTable, PrefillChunk, StepEnvelope, StepMessage, int_column
    from tpengine.paging import blocks_for
    from tpengine.sampling_params import SamplingParams, SamplingRecord

    assert llm.scheduler.is_finished() and llm.kv_cache_usage == 0.0, "the engine must be idle: its blocks are used"
    runner, k, context_len = llm.executor.runner, args.num_spec_tokens, args.context_len
    blocks_per_seq = blocks_for(context_len + k + 1, llm.config.kvcache_block_size)
    assert batch * blocks_per_seq <= runner.num_kvcache_blocks, "the cache is smaller than the limits it was made for"
    seq_ids = [-1 - i for i in range(batch)]  # the engine's ids are >= 0: no table of its is touched
    prompts = random_prompts(random.Random(7), batch, context_len + k + 1, llm.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=k + 2, ignore_eos=True)
    records = [SamplingRecord(params, frozenset(), prompt[:context_len], context_len) for prompt in prompts]
    tables = [BlockTable(seq_id, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)))
              for i, seq_id in enumerate(seq_ids)]
    prefill = StepMessage(prefill=[PrefillChunk(seq_id, prompt[:context_len], 0, True)
                                   for seq_id, prompt in zip(seq_ids, prompts)], new_tables=tables)
    plain = StepMessage(int_column(seq_ids), int_column([prompt[context_len] for prompt in prompts]),
                        int_column([context_len + 1] * batch))
    verify = StepMessage(prefill=[PrefillChunk(seq_id, prompt[context_len:], context_len, True, k)
                                  for seq_id, prompt in zip(seq_ids, prompts)])
    verify_records = [r.ahead(i) if i else r for r in records for i in range(k + 1)]
    times = {"plain": [], "verify": []}
    try:
        runner.execute(StepEnvelope(prefill), records)
        for i in range(3 + args.verify_steps):
            for kind, step, sampling in (("plain", plain, records), ("verify", verify, verify_records)):
                started = time.perf_counter()
                runner.execute(StepEnvelope(step), sampling)
                if i >= 3:
                    times[kind].append(time.perf_counter() - started)
    finally:
        runner.inputs.block_tables.update(StepMessage(released=seq_ids))
    return statistics.median(times["plain"]) * 1e3, statistics.median(times["verify"]) * 1e3


# --- report ---------------------------------------------------------------------------------------

def acceptance(stats: dict) -> tuple[float | None, float | None]:
    """(accepted drafts / drafts, accepted drafts per verify row); None where there was no draft."""
    if not stats or not stats["num_draft_tokens"]:
        return None, None
    return stats["num_accepted_tokens"] / stats["num_draft_tokens"], stats["num_accepted_tokens"] / stats["num_drafts"]


def paired_ratio(runs: dict, key: tuple) -> float:
    """The median over rounds of a configuration's tok/s over its baseline's in the same round: on a machine
    whose speed drifts from round to round, steadier than the ratio of two best rounds."""
    rounds = runs[key]
    baseline = runs[rounds[0]["baseline"], *key[1:]]
    return statistics.median(run["tok_s"] / base["tok_s"] for run, base in zip(rounds, baseline))


def table(method: str, best: dict, runs: dict) -> list[str]:
    lines = [f"| workload | batch | plain tok/s | {method} tok/s | speed-up | same round, median | acceptance "
             "| accepted per verify row | same tokens |", "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for (name, workload, batch), run in best.items():
        if name != method:
            continue
        plain = best[run["baseline"], workload, batch]
        rate, per_row = acceptance(run["stats"])
        lines.append(f"| {workload} | {batch} | {plain['tok_s']:,.1f} | {run['tok_s']:,.1f} | "
                     f"{run['tok_s'] / plain['tok_s']:.2f}x | {paired_ratio(runs, (name, workload, batch)):.2f}x | "
                     f"{'-' if rate is None else f'{rate:.0%}'} | "
                     f"{'-' if per_row is None else f'{per_row:.2f}'} | "
                     f"{'yes' if run['token_ids'] == plain['token_ids'] else '**no**'} |")
    return lines


def aims(best: dict, runs: dict, verify: dict, args) -> list[str]:
    lines = []
    check = lambda ok, text: lines.append(f"- {'met' if ok else 'NOT met'}: {text}")  # noqa: E731
    ngram = best.get((NGRAM, "repeat", 1))
    if ngram is not None:
        ratio = ngram["tok_s"] / best[PLAIN, "repeat", 1]["tok_s"]
        rate, _ = acceptance(ngram["stats"])
        check(ratio >= NGRAM_BATCH1_AIM, f"n-gram at batch 1 >= {NGRAM_BATCH1_AIM}x plain decode where acceptance is "
                                         f"high (repeat workload, acceptance {0 if rate is None else rate:.0%}): "
                                         f"{ngram['tok_s']:,.1f} vs {best[PLAIN, 'repeat', 1]['tok_s']:,.1f} tok/s = "
                                         f"{ratio:.2f}x")
    if 1 in verify:
        plain_ms, verify_ms = verify[1]
        check(verify_ms / plain_ms <= VERIFY_COST_AIM,
              f"a verify step of k + 1 = {args.num_spec_tokens + 1} tokens at batch 1 <= {VERIFY_COST_AIM}x a plain "
              f"decode step (context {args.context_len}): {verify_ms:.3f} vs {plain_ms:.3f} ms = "
              f"{verify_ms / plain_ms:.3f}x")
    large = [(key, run) for key, run in best.items() if key[0] != PLAIN and key[2] >= LARGE_BATCH]
    if large:
        # judged by the same-round ratios' median: the best rounds of two configurations need not be one round
        ratios = [(paired_ratio(runs, key), *key) for key, _ in large]
        worst = min(ratios)
        check(worst[0] >= LARGE_BATCH_LOSS_AIM,
              f"at batch {LARGE_BATCH}+ speculation never worse than plain by more than "
              f"{1 - LARGE_BATCH_LOSS_AIM:.0%} (median of {args.repeat} same-round ratios): worst {worst[0]:.2f}x "
              f"({worst[1]}, {worst[2]}, batch {worst[3]}); "
              + ", ".join(f"{name} {workload} batch {batch} {r:.2f}x" for r, name, workload, batch in ratios))
    return lines


# --- the run --------------------------------------------------------------------------------------

def target_paths(args, tmp: str) -> tuple[str, str | None, str | None, str]:
    """(target, the draft rows' target, draft, label): the draft ones None with --no-draft. The default model's
    draft and damped copy are kept in CACHE; a --model's or --quick's are written to tmp."""
    if args.model:
        target, keep, label = args.model, tmp, f"`{args.model}`"
    elif args.quick:
        target = write_model("cpu", os.path.join(tmp, "model"), QUICK_MODEL)
        keep, label = tmp, "random-weight Qwen3 (QUICK_MODEL)"
    else:
        target = write_model("cpu", os.path.join(CACHE, CACHED_MODEL_FOLDERS["small"]), LOW_BATCH_MODEL)
        keep, label = CACHE, "random-weight Qwen3 (LOW_BATCH_MODEL)"
    if args.no_draft:
        return target, None, None, label
    name = os.path.basename(os.path.normpath(target))
    draft = write_draft(target, os.path.join(keep, f"{name}_draft_{args.draft_layers}_layers"), args.draft_layers)
    draft_target = target if args.damp_skipped_layers == 1 else write_damped_target(
        target, os.path.join(keep, f"{name}_damped_{args.damp_skipped_layers:g}_past_{args.draft_layers}"),
        args.draft_layers, args.damp_skipped_layers)
    return target, draft_target, draft, label


def start_engines(args, target: str, draft_target: str | None, draft: str | None):
    """{configuration: (engine, its plain baseline's name)}, and the line saying why the draft rows are skipped
    (None when they run)."""
    engines, skipped = {PLAIN: (make_engine(target, args), PLAIN)}, None
    for method, spec in spec_configs(args, draft).items():
        model = draft_target if method == DRAFT else target
        baseline = PLAIN
        if model != target:
            baseline = f"{PLAIN} (damped target)"
            engines.setdefault(baseline, (make_engine(model, args), baseline))
        try:
            engines[method] = (make_engine(model, args, spec), baseline)
        except ValueError as error:
            if method != DRAFT:
                raise
            skipped = f"draft-model rows skipped: the engine refuses speculative_config={spec!r}: {error}"
            if baseline != PLAIN:
                engines.pop(baseline)[0].shutdown()
    return engines, skipped


def main(argv=None) -> None:
    args = parse_args(argv)
    from transformers import AutoConfig

    record = Record("bench_spec", argv, machine_line("cpu", torch.get_num_threads()))
    with tempfile.TemporaryDirectory(prefix="tpengine-spec-") as tmp:
        target, draft_target, draft, label = target_paths(args, tmp)
        config = AutoConfig.from_pretrained(target)
        engines, skipped = start_engines(args, target, draft_target, draft)
        runs, verify, whole = {}, {}, {}  # every round's figures
        try:
            prompts = {workload: workload_prompts(workload, args, config.vocab_size) for workload in args.workloads}
            names = list(engines)
            for round_ in range(args.repeat):
                order = names[round_ % len(names):] + names[:round_ % len(names)]  # the order rotates
                for workload in args.workloads:
                    for batch in args.batch_sizes:
                        for name in order:
                            llm, baseline = engines[name]
                            run = decode(llm, prompts[workload], batch, args.output_len)
                            run.update(tok_s=run["tokens"] / run["seconds"], baseline=baseline)
                            runs.setdefault((name, workload, batch), []).append(run)
                for workload in args.workloads:  # every prompt at once, generate() timed whole
                    for name in order:
                        whole.setdefault((name, workload), []).append(
                            generate_seconds(engines[name][0], prompts[workload], args.output_len))
                for batch in args.batch_sizes:
                    verify.setdefault(batch, []).append(verify_cost_ms(engines[PLAIN][0], batch, args))
                figures = ", ".join(f"{name} {workload} batch {batch} {rounds[-1]['tok_s']:,.1f}"
                                    for (name, workload, batch), rounds in runs.items())
                print(f"[round {round_ + 1}/{args.repeat}] tok/s {figures}; load {load_average()}", file=sys.stderr)
            agreement = {}
            if draft is not None:  # on each workload's first 4 prompts
                agreement = draft_agreement(draft_target, draft,
                                            {workload: pool[:4] for workload, pool in prompts.items()}, args.output_len)
        finally:
            engines_baseline = {name: baseline for name, (_, baseline) in engines.items()}
            for llm, _ in engines.values():
                llm.shutdown()
    best = {key: min(rounds, key=lambda run: run["seconds"]) for key, rounds in runs.items()}
    best_verify = {batch: min(rounds) for batch, rounds in verify.items()}  # the round with the fastest decode step

    fields, k = record.fields, args.num_spec_tokens
    print(f"command: `{fields['command']}`")
    print(f"machine: {fields['machine']}")
    print(f"date {fields['date']}, tpengine revision {fields['revision']}, load average (1/5/15 min) "
          f"{fields['load_average_before']} before, {load_average()} after")
    print(f"model: {label}: hidden {config.hidden_size}, {config.num_hidden_layers} layers, vocab {config.vocab_size}"
          f" (~{num_params(config) / 1e6:,.0f}M params), {args.dtype}")
    print(f"decode: {max(args.batch_sizes)} prompts of {args.context_len} tokens a workload, in groups of the batch "
          f"size (repeat: a {args.segment_len}-token segment repeated), "
          f"{args.output_len} tokens timed after the prefill's, greedy, ignore_eos; best of {args.repeat} round(s); "
          f"k = {k}, n-gram lookup {args.prompt_lookup_min}-{args.prompt_lookup_max}")
    if draft is not None:
        damped = "" if draft_target == target else (f", against the target with layers {args.draft_layers}+ "
                                                    f"damped by {args.damp_skipped_layers:g} (its own plain baseline)")
        seen = "; teacher-forced top-1 agreement with its target's greedy tokens: " + ", ".join(
            f"{workload} {value:.0%}" for workload, value in agreement.items())
        print(f"draft: the target's first {args.draft_layers} of {config.num_hidden_layers} layers{damped}{seen}")
    print()
    print(f"n-gram (k = {k}, lookup {args.prompt_lookup_min}-{args.prompt_lookup_max}):")
    print()
    print("\n".join(table(NGRAM, best, runs)))
    print()
    if skipped:
        print(skipped)
    elif draft is not None:
        print(f"draft model (a {args.draft_layers}-layer self-draft, k = {k}):")
        print()
        print("\n".join(table(DRAFT, best, runs)))
    print()
    print(f"Whole generate() of each workload's {max(args.batch_sizes)} prompts at once ({args.output_len + 1} "
          f"tokens each, prefill included), best of {args.repeat}:")
    print()
    print("| workload | configuration | seconds | baseline seconds | speed-up | same round, median |")
    print("|---|---|---:|---:|---:|---:|")
    for (name, workload), rounds in whole.items():
        baseline = engines_baseline[name]
        if name != baseline:
            base = min(whole[baseline, workload])
            paired = statistics.median(b / r for r, b in zip(rounds, whole[baseline, workload]))
            print(f"| {workload} | {name} | {min(rounds):.2f} | {base:.2f} | {base / min(rounds):.2f}x "
                  f"| {paired:.2f}x |")
    print()
    print(f"Verify cost: runner.execute of one step at context {args.context_len}, median of {args.verify_steps}:")
    print()
    print(f"| batch | plain decode step ms | verify step ms ({k + 1} rows a sequence) | verify / plain |")
    print("|---:|---:|---:|---:|")
    for batch, (plain_ms, verify_ms) in best_verify.items():
        print(f"| {batch} | {plain_ms:.3f} | {verify_ms:.3f} | {verify_ms / plain_ms:.2f}x |")
    print()
    lines = aims(best, runs, best_verify, args)
    print("\n".join(lines))
    record.write(args.json, model=dict(model_fields(config), path=target), dtype=args.dtype,
                 draft=None if draft is None else dict(path=draft, layers=args.draft_layers, target=draft_target,
                                                       damp_skipped_layers=args.damp_skipped_layers,
                                                       agreement=agreement, skipped=skipped),
                 settings=dict(context_len=args.context_len, segment_len=args.segment_len, output_len=args.output_len,
                               num_spec_tokens=k, prompt_lookup_min=args.prompt_lookup_min,
                               prompt_lookup_max=args.prompt_lookup_max, rounds=args.repeat),
                 decode=[dict(config=name, workload=workload, batch=batch, baseline=run["baseline"],
                              seconds=run["seconds"], tokens=run["tokens"], steps=run["steps"], stats=run["stats"],
                              same_tokens=run["token_ids"] == runs[run["baseline"], workload, batch][0]["token_ids"])
                         for (name, workload, batch), rounds in runs.items() for run in rounds],
                 generate=[dict(config=name, workload=workload, baseline=engines_baseline[name], seconds=seconds)
                           for (name, workload), rounds in whole.items() for seconds in rounds],
                 verify_cost=[dict(batch=batch, plain_ms=plain_ms, verify_ms=verify_ms)
                              for batch, rounds in verify.items() for plain_ms, verify_ms in rounds],
                 aims=lines)


if __name__ == "__main__":
    main()
