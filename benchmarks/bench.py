"""Offline throughput: tpengine vs transformers' `generate`, same model, same prompts, same run.

tpengine's side alone, on any model and at fixed lengths, is `tpengine bench throughput`; both time a generate the
same way (tpengine/bench/timing.py's time_generate).

The workload is nano-vllm's bench.py shape: random prompt token ids, input and output lengths
drawn uniformly from a range, ignore_eos=True so every request writes exactly its max_tokens,
SamplingParams(temperature=0.6) (nano-vllm's setting; --temperature 0 for greedy), seed 0.
The model is a random-weight Qwen3 written locally with transformers' own
Qwen3ForCausalLM(config).save_pretrained (nothing is downloaded), or --model for a checkpoint.

Output tokens/s counts only the requested output tokens (sum of max_tokens), divided by the
wall time of the generate calls alone (model loading and the warm-up excluded). tpengine warms up on two
small batches shaped like the timed run (prefill of several sequences at two sizes, decode batches
shrinking to 1, the same sampling), so torch.compile builds nothing inside the timed window; on CUDA
the table says how many graphs it built there all the same (TORCH_LOGS=recompiles shows which).

transformers' baseline: `model.generate` over the prompts in batches of --hf-batch-size,
left-padded with an attention mask, the same sampling (do_sample with the same temperature,
top_k/top_p off; greedy when --temperature 0), max_new_tokens = min_new_tokens = the batch's
largest output length (EOS cannot end it early), default SDPA attention and dynamic KV cache.
Only each sequence's own requested output tokens count as useful; the extra tokens shorter
requests write while their batch finishes are waste that static batching pays and continuous
batching does not. By default prompts are sorted by output length (then input length) before
batching, which keeps that waste and the padding small: the strongest simple way to run a
static batcher offline (--hf-order given batches them as drawn). Every batch size given is run
and the fastest is used for the ratio (all are printed); on 2 CPU cores 16 and 32 were the
best of 8/16/32/64, within a few percent of each other.

Both sides run in one process, one after the other, each after its own warm-up;
tpengine gets a fresh LLM each round, so a repeat never hits the prefix cache an earlier round
filled. --repeat N alternates the two N times and keeps each side's fastest run: use it on a
shared or noisy machine (the table prints the load average before and after).

CPU defaults (about 1.5 minutes on 2 idle cores): a Qwen3-shaped model with hidden 512,
8 layers, 8 heads / 4 KV heads of 64, intermediate 1536, vocab 16384, tied embeddings
(~34M parameters, float32, initializer_range 0.02); 64 sequences, inputs 16..256 tokens,
outputs 16..128 tokens (~9.7k prompt and ~4.9k output tokens). Big enough that the matmuls
run near the cores' peak and prefill, decode attention and the LM head all show in a
profile, as on a real model; small enough that a run takes a couple of minutes.
--max-output-len 256 gives nano-vllm's proportions (equal input and output ranges).

CUDA defaults: nano-vllm's bench -- a Qwen3-0.6B-shaped config (hidden 1024, 28 layers,
16 heads, 8 KV heads, head_dim 128, intermediate 3072, vocab 151936, tied embeddings,
max_position_embeddings 40960) with random weights, bfloat16, 256 sequences, input and output
lengths 100..1024 (nano-vllm reports 1,434 tok/s on an RTX 4070 laptop for its engine).
transformers tries batches of 64 and 256; one that runs out of memory is reported as such.

    .venv/bin/python benchmarks/bench.py                      # CPU, defaults above
    .venv/bin/python benchmarks/bench.py --device cuda        # Qwen3-0.6B shape, 256 seqs
    .venv/bin/python benchmarks/bench.py --repeat 2               # noisy machine: best of 2 each
    .venv/bin/python benchmarks/bench.py --skip-hf --num-seqs 128
    .venv/bin/python benchmarks/bench.py --model /path/to/Qwen3-0.6B --device cuda --tp 2
    .venv/bin/python benchmarks/bench.py --quick              # seconds: QUICK_MODEL, 6 seqs, both engines

--quick (every script here has it, see tpengine/bench/quick.py) runs the same code at small sizes, --help lists
them, in seconds on 2 CPU cores: what tests/benchmarks runs. Flags given alongside it still win.
"""
import argparse
import gc
import os
import shlex
import sys
import tempfile
import time

import torch

from tpengine.bench.models import QUICK_MODEL, model_fields, num_params, write_model
from tpengine.bench.quick import parse_with_quick
from tpengine.bench.results import Record, add_json_flag, git_revision, load_average, machine_line
from tpengine.bench.timing import sync, time_generate
from tpengine.bench.workload import NANO_VLLM, QUICK, RandomWorkload

DEFAULTS = {"cpu": dict(vars(NANO_VLLM["cpu"]), dtype="float32", hf_batch_sizes=[16, 32]),
            "cuda": dict(vars(NANO_VLLM["cuda"]), dtype="bfloat16", hf_batch_sizes=[64, 256])}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--model", help="existing checkpoint folder of a supported family "
                                     "(default: a random-weight Qwen3 in a temp folder)")
    p.add_argument("--model-dir", help="keep the random-weight model in this folder, and reuse it if it is there")
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size for tpengine")
    p.add_argument("--num-seqs", type=int)
    p.add_argument("--min-input-len", type=int)
    p.add_argument("--max-input-len", type=int)
    p.add_argument("--min-output-len", type=int)
    p.add_argument("--max-output-len", type=int)
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"),
                   help="both engines (default: float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--max-num-seqs", type=int, default=512,
                   help="tpengine's max_num_seqs (default 512, the engine's; CUDA graphs are captured up to it)")
    p.add_argument("--temperature", type=float, default=0.6, help="0 = greedy (default 0.6, as nano-vllm)")
    p.add_argument("--hf-batch-size", type=int, nargs="+",
                   help="transformers batch size(s); the best is used (default: 16 32 on cpu, 64 256 on cuda)")
    p.add_argument("--hf-order", choices=("sorted", "given"), default="sorted",
                   help="transformers batches: prompts sorted by output then input length (default), or as drawn")
    p.add_argument("--skip-hf", action="store_true", help="run tpengine only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scheduling-policy", nargs="+", choices=("mixed", "prefill_first"), default=["mixed"],
                   help="tpengine's policy; several are each timed every round, alternating (default mixed)")
    p.add_argument("--repeat", type=int, default=1,
                   help="measure each side this many times, alternating, and keep the fastest (for noisy machines)")
    add_json_flag(p)
    args = parse_with_quick(p, argv, dict(vars(QUICK), max_num_seqs=4, hf_batch_size=[2]),
                            "the QUICK_MODEL of tpengine/bench/models.py (hidden 64, 2 layers)")
    for key, value in DEFAULTS[args.device].items():
        if key == "hf_batch_sizes":
            if args.hf_batch_size is None:
                args.hf_batch_size = value
        elif getattr(args, key) is None:
            setattr(args, key, value)
    if not 1 <= args.min_input_len <= args.max_input_len or not 1 <= args.min_output_len <= args.max_output_len:
        p.error("need 1 <= min <= max for input and output lengths")
    if args.num_seqs < 1 or args.repeat < 1 or min(args.hf_batch_size) < 1 or args.max_num_seqs < 1:
        p.error("--num-seqs, --repeat, --max-num-seqs and --hf-batch-size must be >= 1")
    return args


def make_workload(args, vocab_size: int):
    """nano-vllm's bench: random token ids and lengths, seeded."""
    workload = RandomWorkload(args.num_seqs, args.min_input_len, args.max_input_len, args.min_output_len,
                              args.max_output_len)
    return workload.draw(vocab_size, args.seed)


# --- tpengine -------------------------------------------------------------------------------------

def time_tpengine(args, model: str, prompts, output_lens, compiled_in_window: list | None = None,
                  policy: str = "mixed") -> float:
    """One timed llm.generate over the whole workload, on a fresh engine (so a repeat never hits
    the prefix cache the last round filled); returns its seconds. Appends to compiled_in_window the
    graphs torch.compile built on rank 0 inside the timed window (0 when the warm-up covered every shape)."""
    from tpengine import LLM

    llm = LLM(model, tensor_parallel_size=args.tp, dtype=args.dtype, device=args.device,
              max_model_len=args.max_input_len + args.max_output_len, max_num_seqs=args.max_num_seqs,
              scheduling_policy=policy)
    try:
        elapsed, compiled = time_generate(llm, prompts, output_lens, args.temperature, args.device)
    finally:
        llm.shutdown()
    del llm
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()  # leave the memory to transformers' turn
    if compiled_in_window is not None:
        compiled_in_window.append(compiled)
    return elapsed


# --- transformers ---------------------------------------------------------------------------------

def load_hf(args, model_path: str):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, args.dtype)).to(args.device).eval()
    model.generation_config.eos_token_id = None  # ignore_eos: nothing may end a sequence early
    with torch.inference_mode():
        hf_generate_batch(model, [[1, 2, 3, 4]] * 2, 4, args.temperature, args.device)  # warm-up
    return model


def hf_generate_batch(model, batch_prompts, max_new_tokens: int, temperature: float, device: str):
    """Left-padded batch; exactly max_new_tokens new tokens for every row."""
    width = max(len(p) for p in batch_prompts)
    pad = 0
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch_prompts], device=device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch_prompts], device=device)
    sampling = (dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0
                else dict(do_sample=False))
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=None, use_cache=True,
                         **sampling)
    assert out.shape == (len(batch_prompts), width + max_new_tokens), "transformers stopped early"
    return out


def hf_batches(prompts, output_lens, batch_size: int, order_by: str = "sorted") -> list[list[int]]:
    """Indices per batch: sorted by output length, then input length, longest first; or as drawn."""
    order = list(range(len(prompts)))
    if order_by == "sorted":
        order.sort(key=lambda i: (output_lens[i], len(prompts[i])), reverse=True)
    return [order[s:s + batch_size] for s in range(0, len(order), batch_size)]


def time_hf(args, model, prompts, output_lens, batch_size: int) -> float | None:
    """Seconds for the whole workload in batches of batch_size; None if it ran out of memory."""
    try:
        sync(args.device)
        started = time.perf_counter()
        with torch.inference_mode():
            for idx in hf_batches(prompts, output_lens, batch_size, args.hf_order):
                hf_generate_batch(model, [prompts[i] for i in idx], max(output_lens[i] for i in idx),
                                  args.temperature, args.device)
        sync(args.device)
        return time.perf_counter() - started
    except torch.OutOfMemoryError:
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
        return None


# --- report ---------------------------------------------------------------------------------------

def rate(tokens: int, seconds: float | None) -> str:
    return "out of memory" if seconds is None else f"{tokens / seconds:,.1f}"


def main(argv=None) -> None:
    args = parse_args(argv)
    command = " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + list(argv or sys.argv[1:]))
    num_threads = torch.get_num_threads()
    record = Record("bench", argv, machine_line(args.device, num_threads))
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="tpengine-bench-") as tmp:
        model_path = args.model or write_model(args.device, args.model_dir or os.path.join(tmp, "model"),
                                               QUICK_MODEL if args.quick else None)
        from transformers import AutoConfig
        config = AutoConfig.from_pretrained(model_path)
        prompts, output_lens = make_workload(args, config.vocab_size)
        useful = sum(output_lens)

        ours: dict[str, list[float]] = {policy: [] for policy in args.scheduling_policy}
        compiled_in_window: list[int | None] = []
        hf: dict[int, list[float | None]] = {} if args.skip_hf else {b: [] for b in args.hf_batch_size}
        hf_model = None
        for round_ in range(args.repeat):
            # alternate which policy goes first, so a load change on a shared machine hits both alike
            for policy, times in list(ours.items())[::1 if round_ % 2 == 0 else -1]:
                times.append(time_tpengine(args, model_path, prompts, output_lens, compiled_in_window, policy))
                torch.set_num_threads(num_threads)  # tp > 1 on CPU splits rank 0's threads; give transformers all
                print(f"[round {round_ + 1}/{args.repeat}] tpengine {policy}: {times[-1]:.2f}s "
                      f"({useful / times[-1]:,.1f} tok/s), load {load_average()}", file=sys.stderr)
            if args.skip_hf:
                continue
            if hf_model is None:
                hf_model = load_hf(args, model_path)
            for batch_size in args.hf_batch_size:
                seconds = time_hf(args, hf_model, prompts, output_lens, batch_size)
                hf[batch_size].append(seconds)
                print(f"[round {round_ + 1}/{args.repeat}] transformers batch {batch_size}: "
                      + ("out of memory" if seconds is None else f"{seconds:.2f}s ({useful / seconds:,.1f} tok/s)")
                      + f", load {load_average()}", file=sys.stderr)
        del hf_model

    best_ours = min(min(times) for times in ours.values())
    sampling = "greedy" if args.temperature == 0 else f"temperature={args.temperature}"
    best_of = f", best of {args.repeat}" if args.repeat > 1 else ""
    rows = [
        ("command", f"`{command}`"),
        ("machine", machine_line(args.device, num_threads)),
        ("load average (1/5/15 min)", f"{load_before} before, {load_average()} after"),
        ("tpengine revision", git_revision()),
        ("model", f"{'`' + args.model + '`' if args.model else 'random-weight Qwen3'}: hidden {config.hidden_size}, "
                  f"{config.num_hidden_layers} layers, {config.num_attention_heads} heads / "
                  f"{config.num_key_value_heads} KV heads x {config.head_dim}, intermediate "
                  f"{config.intermediate_size}, vocab {config.vocab_size} (~{num_params(config) / 1e6:,.0f}M "
                  f"params), {args.dtype}"),
        ("workload", f"{args.num_seqs} seqs, input {args.min_input_len}..{args.max_input_len} "
                     f"({sum(len(p) for p in prompts)} tokens), output {args.min_output_len}..{args.max_output_len} "
                     f"({useful} tokens), ignore_eos, {sampling}, seed {args.seed}"),
    ]
    for policy, times in ours.items():
        label = f"tpengine (tp={args.tp}, {args.device}" + (f", {policy})" if len(ours) > 1 else ")")
        rows.append((label,
                     f"**{rate(useful, min(times))} output tok/s** ({useful} tokens in {min(times):.2f}s{best_of})"))
    if len(ours) > 1:
        first, *others = ours
        for other in others:
            rows.append((f"tpengine {first} / {other}", f"{min(ours[other]) / min(ours[first]):.2f}x (time ratio)"))
    if args.device == "cuda":
        counts = ", ".join("n/a" if c is None else str(c) for c in compiled_in_window)
        rows.append(("graphs torch.compile built inside the timed run (rank 0)", f"{counts} (0: warm-up covered every shape)"))
    best_hf = None
    for batch_size, times in hf.items():
        ok = [t for t in times if t is not None]
        generated = sum(len(idx) * max(output_lens[i] for i in idx)
                        for idx in hf_batches(prompts, output_lens, batch_size, args.hf_order))
        label = f"transformers generate, batch {batch_size}" + (", prompts as drawn" if args.hf_order == "given" else "")
        if not ok:
            rows.append((label, "out of memory"))
            continue
        rows.append((label, f"{rate(useful, min(ok))} output tok/s ({useful} useful of {generated} generated "
                            f"tokens in {min(ok):.2f}s{best_of})"))
        if best_hf is None or min(ok) < best_hf[1]:
            best_hf = (batch_size, min(ok))
    if best_hf is not None:
        rows.append(("tpengine / transformers",
                     f"**{best_hf[1] / best_ours:.2f}x** (against transformers' best batch size, {best_hf[0]})"))
    print()
    print("| | |")
    print("|---|---|")
    for key, value in rows:
        print(f"| {key} | {value} |")
    record.write(args.json, device=args.device, tp=args.tp, dtype=args.dtype, model=model_fields(config),
                 workload=dict(num_seqs=args.num_seqs, prompt_tokens=sum(len(p) for p in prompts),
                               output_tokens=useful, temperature=args.temperature, seed=args.seed),
                 seconds={**{f"tpengine {policy}": times for policy, times in ours.items()},
                          **{f"transformers batch {b}": times for b, times in hf.items()}})


if __name__ == "__main__":
    main()
