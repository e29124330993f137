"""Where a decode step's time goes, and how close decode attention comes to the memory's speed.

One engine, one batch of requests that all decode together (same prompt length, same max_tokens,
ignore_eos), driven with llm.step(). For each decode step after a few warm-up steps:

- host time: the wall time of llm.step() (schedule, inputs, forward, LM head, sampling, bookkeeping);
- GPU time: the decode forward alone on the GPU's clock (CUDA events around the CUDA-graph replay, or
  around the eager forward when no graph runs it), so host time - GPU time is what the host adds;
- CUDA-graph replays, counted against decode steps (every decode step should be one replay).

Then the decode attention of one layer alone, on the KV cache and block tables of the last decode step,
timed over repeats: the K/V bytes its sequences hold over that time is the achieved KV-cache read
bandwidth. A device-to-device copy measured in the same run (bytes read + written over its time, about
4.3 TB/s on an H200) is the reference: attention bandwidth / copy rate says how close decode attention
is to the hardware. The whole forward's weight + KV bytes over its GPU time is given the same way.

On CPU the same steps run with wall-clock timers (no CUDA events, no graphs): for checking the script
and for a rough CPU picture.

    python tools/profile_decode.py --device cuda                     # Qwen3-0.6B shape, bf16, 64 x 1024
    python tools/profile_decode.py --device cuda --model-dir /tmp/m  # reuse bench.py's --model-dir model
    python tools/profile_decode.py --device cpu --model PATH --batch-size 4 --context-len 40 --steps 4
    python tools/profile_decode.py --device cpu --quick              # seconds: tpengine.bench's QUICK_MODEL, 3 x 20
"""
import argparse
import os
import random
import statistics
import sys
import tempfile
import time

import torch

from tpengine.bench.models import QUICK_MODEL, num_params, write_model
from tpengine.bench.quick import parse_with_quick


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--model", help="existing checkpoint folder of a supported family (default: bench.py's random-weight model)")
    p.add_argument("--model-dir", help="keep the random-weight model in this folder, and reuse it if it is there")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"),
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--batch-size", type=int, default=64, help="sequences decoding together")
    p.add_argument("--context-len", type=int, default=1024, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=32, help="decode steps measured")
    p.add_argument("--warm-up-steps", type=int, default=3, help="decode steps run before measuring")
    p.add_argument("--attention-repeats", type=int, default=50)
    p.add_argument("--copy-mib", type=int, help="size of the reference copy (default: 1024 on cuda, 64 on cpu)")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    args = parse_with_quick(p, argv, dict(batch_size=3, context_len=20, steps=3, warm_up_steps=1, attention_repeats=2,
                                          copy_mib=4), "tpengine.bench's QUICK_MODEL")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.copy_mib = args.copy_mib or (1024 if args.device == "cuda" else 64)
    if min(args.batch_size, args.context_len, args.steps, args.attention_repeats, args.copy_mib) < 1:
        p.error("sizes and counts must be >= 1")
    return args


class Clock:
    """Timing on the device's clock: CUDA events on the current stream, or the host clock on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def elapsed_ms(self, start, end) -> float:
        """ms between two marks; on CUDA only once the end mark has completed (synchronize first)."""
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def time_ms(self, fn, repeats: int, warm_ups: int = 3) -> float:
        """Mean ms of fn() over repeats, after warm_ups calls."""
        for _ in range(warm_ups):
            fn()
        self.sync()
        start = self.mark()
        for _ in range(repeats):
            fn()
        end = self.mark()
        self.sync()
        return self.elapsed_ms(start, end) / repeats


class DecodeRecorder:
    """Wraps the runner's decode forward (graph replay, else the eager model) with device-clock marks, and
    the executor's step to know which steps were decode steps."""

    def __init__(self, llm, clock: Clock):
        self.clock = clock
        executor, runner = llm.executor, llm.executor.runner
        self.runner = runner
        self.steps: list[tuple[bool, int]] = []     # (is_prefill, batch) per executed step
        self.forward_marks: list[tuple[object, object]] = []
        self.replays = 0
        self.last_decode = None                      # (input_ids, positions, meta) of the latest decode step
        self.recording = False

        submit = executor.submit  # one stage: a step runs whole in submit

        def recorded_submit(plan):
            self.steps.append((bool(plan.message.prefill), plan.num_decode + len(plan.message.prefill)))
            return submit(plan)
        executor.submit = recorded_submit

        prepare = runner.inputs.prepare

        def recorded_prepare(step):
            inputs = prepare(step)
            if not step.prefill:
                self.last_decode = inputs.input_ids, inputs.positions, inputs.meta
            return inputs
        runner.inputs.prepare = recorded_prepare

        replays = runner.decode_path.replays  # CUDA graphs on a GPU, recorded forwards on the CPU (or None)
        if replays is not None and runner.device.type == "cuda":
            graphs_run = replays.run

            def timed_replay(*args):
                self.replays += 1
                return self._timed(graphs_run, *args)
            replays.run = timed_replay
        elif replays is not None:  # the CPU's replayed decode steps: the forward without the model's Python
            cpu_replays_run = replays.run
            replays.run = lambda *args: self._timed(cpu_replays_run, *args)
        forward = runner.model.forward

        def timed_forward(input_ids, positions, meta):
            if meta.is_prefill:
                return forward(input_ids, positions, meta)
            return self._timed(forward, input_ids, positions, meta)
        runner.model.forward = timed_forward

    def _timed(self, fn, *args):
        if not self.recording:
            return fn(*args)
        start = self.clock.mark()
        out = fn(*args)
        self.forward_marks.append((start, self.clock.mark()))
        return out


def attention_bandwidth(recorder: DecodeRecorder, clock: Clock, repeats: int) -> tuple[float, int]:
    """ms of one layer's decode attention on the last decode step's cache and block tables, and the K/V
    bytes its sequences hold."""
    runner = recorder.runner
    _, _, meta = recorder.last_decode
    layer = runner.attention_layers[0]
    q = torch.randn(meta.context_lens.numel(), layer.num_heads, layer.head_dim, dtype=runner.dtype,
                    device=runner.device)
    with torch.inference_mode():
        ms = clock.time_ms(lambda: layer.backend.decode(q, layer.k_cache, layer.v_cache, meta, layer.params), repeats)
    kv_bytes = 2 * int(meta.context_lens.sum()) * layer.num_kv_heads * layer.head_dim * layer.k_cache.element_size()
    return ms, kv_bytes


def copy_rate(clock: Clock, device: torch.device, mib: int, repeats: int = 10) -> float:
    """Bytes read + written per second by a device-to-device copy of mib MiB."""
    src = torch.empty(mib << 20, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    ms = clock.time_ms(lambda: dst.copy_(src), repeats)
    return 2 * src.numel() / (ms / 1e3)


def run(args) -> list[str]:
    from tpengine import LLM, SamplingParams

    device = torch.device(args.device)
    clock = Clock(device)
    with tempfile.TemporaryDirectory(prefix="tpengine-profile-") as tmp:
        model = args.model or write_model(args.device, args.model_dir or os.path.join(tmp, "model"),
                                          QUICK_MODEL if args.quick else None)
        max_tokens = args.warm_up_steps + args.steps + 1  # the first token comes from the prefill
        llm = LLM(model, device=args.device, dtype=args.dtype, max_num_seqs=args.batch_size,
                  max_model_len=args.context_len + max_tokens, attention_backend=args.attention_backend,
                  enforce_eager=args.enforce_eager)
        try:
            recorder = DecodeRecorder(llm, clock)
            rng = random.Random(0)
            vocab = llm.executor.runner.hf_config.vocab_size
            params = SamplingParams(temperature=args.temperature, max_tokens=max_tokens, ignore_eos=True)
            for _ in range(args.batch_size):
                llm.add_request([rng.randrange(min(vocab, 10000)) for _ in range(args.context_len)], params,
                                stream=False)
            host_ms, decode_steps = [], 0
            while llm.has_unfinished_requests():
                recorder.recording = decode_steps >= args.warm_up_steps
                started = time.perf_counter()
                llm.step()
                elapsed_ms = (time.perf_counter() - started) * 1e3
                is_prefill, batch = recorder.steps[-1]
                if not is_prefill:
                    if recorder.recording:
                        host_ms.append(elapsed_ms)
                    decode_steps += 1
            clock.sync()
            gpu_ms = [clock.elapsed_ms(start, end) for start, end in recorder.forward_marks]
            attention_ms, kv_bytes = attention_bandwidth(recorder, clock, args.attention_repeats)
            runner = recorder.runner
            weights = num_params(runner.hf_config) * runner.dtype.itemsize  # what one forward reads
            kv_all_layers = kv_bytes * len(runner.attention_layers)
            backend = runner.backend_name
            graphs = runner.device.type == "cuda" and runner.decode_path.replays is not None
        finally:
            llm.shutdown()
    copy = copy_rate(clock, device, args.copy_mib)

    host, gpu = statistics.median(host_ms), statistics.median(gpu_ms) if gpu_ms else float("nan")
    attention_rate = kv_bytes / (attention_ms / 1e3)
    forward_rate = (weights + kv_all_layers) / (gpu / 1e3)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    forward_label = "GPU: decode forward (CUDA events)" if clock.cuda else "CPU: decode forward (host clock)"
    return [
        f"device: {name}; torch {torch.__version__}; {args.dtype}; attention backend {backend}; "
        f"CUDA graphs {'on' if graphs else 'off'}",
        f"batch {args.batch_size} x context {args.context_len}; {len(host_ms)} decode steps measured after "
        f"{args.warm_up_steps} warm-up steps",
        "",
        "| per decode step (median) | ms |",
        "|---|---:|",
        f"| host: llm.step() wall time | {host:.3f} |",
        f"| {forward_label} | {gpu:.3f} |",
        f"| host overhead (host - forward) | {host - gpu:.3f} ({(host - gpu) / host:.0%} of the step) |",
        f"| output tokens/s at this batch | {args.batch_size / (host / 1e3):,.0f} |",
        "",
        f"CUDA-graph replays: {recorder.replays} in {decode_steps} decode steps"
        + (" (graphs off)" if not graphs else ""),
        f"host ms per measured step: min {min(host_ms):.3f}, max {max(host_ms):.3f}",
        "",
        "| bandwidth | GB/s | / copy rate |",
        "|---|---:|---:|",
        f"| device-to-device copy, {args.copy_mib} MiB (read + written) | {copy / 1e9:,.1f} | 1.00 |",
        f"| decode attention, one layer: {kv_bytes / 1e6:,.1f} MB of K/V read in {attention_ms * 1e3:,.1f} us "
        f"| {attention_rate / 1e9:,.1f} | **{attention_rate / copy:.2f}** |",
        f"| decode forward: {weights / 1e6:,.0f} MB weights + {kv_all_layers / 1e6:,.0f} MB K/V in {gpu:.3f} ms "
        f"| {forward_rate / 1e9:,.1f} | {forward_rate / copy:.2f} |",
    ]


def main(argv=None) -> None:
    args = parse_args(argv)
    print("\n".join(run(args)))


if __name__ == "__main__":
    sys.exit(main())
