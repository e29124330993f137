"""Qwen2.5-VL on the CPU: time to first token for one image, tpengine against transformers on the same checkpoint,
and the vision tower's share of it, in one run.

Model: a random-weight Qwen2.5-VL checkpoint of Qwen2.5-VL-3B-Instruct's shape, written once in bfloat16 by
transformers (Qwen2_5_VLForConditionalGeneration, built on the meta device and filled in bfloat16, so writing it
holds one copy, ~7.5 GB) into --model-dir (default ~/.cache/tpengine-bench/qwen2_5_vl_3b_shape_model), or
--model PATH. The shape is Qwen/Qwen2.5-VL-3B-Instruct's published config.json:
- text: hidden 2048, intermediate 11008, 36 layers, 16 heads / 2 KV heads (head_dim 128), vocab 151,936,
  rms_norm_eps 1e-6, rope_theta 1e6, mrope_section [16, 24, 24], max_position_embeddings 128000,
  tie_word_embeddings true (the 3B ties its head to the embedding; the 7B does not), qkv bias;
- vision: depth 32, hidden 1280, intermediate 3420, 16 heads, out_hidden 2048, patch 14, spatial merge 2,
  temporal patch 2, window 112, fullatt_block_indexes [7, 15, 23, 31] (~0.67B parameters);
- image processor: Qwen2VLImageProcessor's defaults (min_pixels 56*56, max_pixels 28*28*1280; the published
  preprocessor_config.json allows up to 12,845,056 pixels, which changes nothing for a 448 x 448 image).
The tokenizer is tpengine.tiny_model's byte tokenizer (256 bytes, EOS 256) with the vision tokens after it:
<|vision_start|> 257, <|vision_end|> 258, <|image_pad|> 259, <|video_pad|> 260, and the config's token ids point
at them (the published ids are 151652-151656; the embedding keeps its 151,936 rows, most unused).

Workload: one --image-size x --image-size random RGB image (448: 32 x 32 patches, 256 image tokens after the 2 x 2
merge) between a short text prompt's tokens, max_tokens 1, greedy. Time to first token (TTFT) is the wall time
from the PIL image and token ids to the first token, the image processor included:
- tpengine: LLM(path, dtype=--dtype, device="cpu", enable_prefix_caching=False) so every run encodes the image;
  llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": image}}], max_tokens=1).
- transformers: Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=--dtype): the checkpoint's image
  processor (pixel_values, image_grid_thw), the image placeholder grown to its tokens, then
  generate(max_new_tokens=1) with mm_token_type_ids (1 at image tokens: transformers 5 computes M-RoPE positions
  from it) and model.model.rope_deltas reset first.
The encoder's share: each engine's vision tower alone on the same processed image, --repeat times: tpengine's
model on rank 0's runner in this process (llm.executor.runner.model.encode_images, tp 1), transformers'
model.model.visual(pixel_values, grid_thw=...). Share = encoder ms / TTFT ms (medians).
Each engine does one untimed warm-up run, then --repeat timed runs; reported figures are medians (range). The
engines run one after the other (tpengine first, then it is shut down), not interleaved, so the 3B shape needs one
copy of the weights in memory at a time.
--dtype defaults to bfloat16 where the CPU has AVX512-BF16, else float32.

    .venv/bin/python benchmarks/bench_vision.py --repeat 3 --json /tmp/vision.json   # 3B shape: writes ~7.5 GB once
    .venv/bin/python benchmarks/bench_vision.py --model /path/to/Qwen2.5-VL-3B-Instruct --repeat 3
    .venv/bin/python benchmarks/bench_vision.py --quick   # seconds: tests/models/vision.py's tiny settings, 112x112
"""
import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

from tpengine.bench.models import CACHE
from tpengine.bench.quick import parse_with_quick
from tpengine.bench.results import Record, add_json_flag, load_average, machine_line

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
EOS_ID, VISION_START_ID, VISION_END_ID, IMAGE_TOKEN_ID, VIDEO_TOKEN_ID = 256, 257, 258, 259, 260

# Qwen/Qwen2.5-VL-3B-Instruct's config.json (its token ids replaced by the byte tokenizer's, above)
QWEN2_5_VL_3B_TEXT = dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                          num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=128000,
                          rms_norm_eps=1e-6, hidden_act="silu", initializer_range=0.02,
                          rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                           "mrope_section": [16, 24, 24]},
                          eos_token_id=EOS_ID, bos_token_id=None, tie_word_embeddings=True)
QWEN2_5_VL_3B_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                            patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                            fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu", in_channels=3,
                            tokens_per_second=2, initializer_range=0.02)
# tests/models/vision.py's tiny settings (--quick): head_dim 16, window of 2 x 2 merged patches
QUICK_TEXT = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6, initializer_range=0.1,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                  eos_token_id=EOS_ID, bos_token_id=None, tie_word_embeddings=False)
QUICK_VISION = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=14,
                    spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1],
                    initializer_range=0.1)
QUICK_PIXELS = dict(min_pixels=28 * 28 * 8, max_pixels=28 * 28 * 64)
MODEL_FOLDER = "qwen2_5_vl_3b_shape_model"
TEXT_BEFORE, TEXT_AFTER = "User: ", " Describe this image in one sentence.\nAssistant:"
TPENGINE, TRANSFORMERS = "tpengine", "transformers"


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


def default_dtype() -> str:
    return "bfloat16" if "avx512_bf16" in cpu_flags().split() else "float32"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="an existing Qwen2.5-VL checkpoint folder (default: the random 3B-shaped one)")
    p.add_argument("--model-dir", default=os.path.join(CACHE, MODEL_FOLDER),
                   help="where the random 3B-shaped checkpoint is written, or reused if an earlier run wrote it")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=default_dtype(),
                   help="both engines' dtype (default: bfloat16 with AVX512-BF16, else float32)")
    p.add_argument("--image-size", type=int, default=448, help="the square image's side in pixels")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per engine, after one warm-up")
    p.add_argument("--skip-transformers", action="store_true", help="tpengine alone")
    add_json_flag(p)
    args = parse_with_quick(p, argv, dict(image_size=112, repeat=2),
                            "tests/models/vision.py's tiny Qwen2.5-VL settings, written to a temporary folder")
    if min(args.image_size, args.repeat) < 1:
        p.error("--image-size and --repeat must be >= 1")
    return args


# --- the checkpoint ----------------------------------------------------------------------------------------------

def write_checkpoint(path: str, text: dict, vision: dict, pixels: dict, dtype: torch.dtype) -> str:
    """A random Qwen2.5-VL checkpoint in path (reused if complete), with its image processor and byte tokenizer.
    Built on the meta device and filled in place in dtype: one copy of the weights in memory."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessor

    from tpengine.tiny_model import write_byte_tokenizer

    done = os.path.join(path, ".complete")
    if os.path.exists(done):
        return path
    os.makedirs(path, exist_ok=True)
    started = time.perf_counter()
    print(f"writing a random Qwen2.5-VL checkpoint to {path} ...", file=sys.stderr)
    write_byte_tokenizer(path, special_tokens=VISION_TOKENS)
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN_ID,
                              video_token_id=VIDEO_TOKEN_ID, vision_start_token_id=VISION_START_ID,
                              vision_end_token_id=VISION_END_ID, eos_token_id=EOS_ID,
                              tie_word_embeddings=text["tie_word_embeddings"])
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # the meta parameters in dtype, so to_empty allocates them so
    try:
        with torch.device("meta"):
            model = Qwen2_5_VLForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(previous)
    model = model.to_empty(device="cpu").to(dtype)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():  # each tied tensor once: named_parameters dedupes
            if "norm" in name or name.endswith("ln_q.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.02, generator=generator)
            else:
                param.normal_(0.0, text["initializer_range"], generator=generator)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.generation_config.eos_token_id = EOS_ID
    model.save_pretrained(path)
    Qwen2VLImageProcessor(**pixels).save_pretrained(path)
    del model
    gc.collect()
    open(done, "w").close()
    print(f"wrote it in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return path


def random_image(size: int, seed: int = 0):
    from PIL import Image
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def prompt_ids(path: str, config: dict) -> list[int]:
    """The text before, one image placeholder between the vision markers (the config's ids: an existing
    checkpoint's own), the text after (tpengine grows the placeholder to the image's tokens)."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(path)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    markers = [config["vision_start_token_id"], config["image_token_id"], config["vision_end_token_id"]]
    return encode(TEXT_BEFORE) + markers + encode(TEXT_AFTER)


def processed(path: str, image):
    """The checkpoint's image processor's pixel_values and image_grid_thw."""
    from transformers import AutoImageProcessor
    out = AutoImageProcessor.from_pretrained(path)(images=[image], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def timed(fn, repeat: int) -> tuple[list[float], object]:
    """ms of repeat calls after one untimed warm-up, and the last call's result."""
    result = fn()
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        result = fn()
        times.append((time.perf_counter() - started) * 1e3)
    return times, result


# --- the engines -------------------------------------------------------------------------------------------------

def measure_tpengine(path: str, ids: list[int], image, args) -> dict:
    from tpengine import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(path, dtype=args.dtype, device="cpu", enable_prefix_caching=False, max_num_seqs=1,
              max_model_len=4096)
    load_s = time.perf_counter() - started
    try:
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        request = [{"prompt_token_ids": ids, "multi_modal_data": {"image": image}}]
        ttft, outputs = timed(lambda: llm.generate(request, params, use_tqdm=False), args.repeat)
        print(f"tpengine TTFT ms {[round(t, 1) for t in ttft]}; load {load_average()}", file=sys.stderr)
        runner = llm.executor.runner
        pixel_values, grid = processed(path, image)
        pixels = pixel_values.to(runner.dtype)
        grids = [tuple(int(x) for x in grid[0])]
        with torch.inference_mode():
            encoder, embeddings = timed(lambda: runner.model.encode_images(pixels, grids), args.repeat)
        print(f"tpengine encoder ms {[round(t, 1) for t in encoder]}", file=sys.stderr)
        return dict(ttft_ms=ttft, encoder_ms=encoder, load_s=load_s, token=outputs[0].outputs[0].token_ids[0],
                    image_tokens=int(embeddings.shape[0]), prompt_tokens=len(outputs[0].prompt_token_ids),
                    dtype=str(runner.dtype).removeprefix("torch."))
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        torch.set_default_dtype(torch.float32)  # the in-process runner set its own


def measure_transformers(path: str, ids: list[int], image, args) -> dict:
    from transformers import AutoImageProcessor, Qwen2_5_VLForConditionalGeneration

    started = time.perf_counter()
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    load_s = time.perf_counter() - started
    image_processor = AutoImageProcessor.from_pretrained(path)
    merge = model.config.vision_config.spatial_merge_size ** 2
    image_token = model.config.image_token_id

    def first_token():
        out = image_processor(images=[image], return_tensors="pt")
        count = int(out["image_grid_thw"][0].prod()) // merge
        input_ids = [t for token in ids for t in ([token] * count if token == image_token else [token])]
        tensor = torch.tensor([input_ids])
        model.model.rope_deltas = None  # the previous run's: generate would reuse it
        with torch.inference_mode():
            generated = model.generate(
                input_ids=tensor, attention_mask=torch.ones_like(tensor), pixel_values=out["pixel_values"],
                image_grid_thw=out["image_grid_thw"], mm_token_type_ids=(tensor == image_token).long(),
                max_new_tokens=1, do_sample=False, eos_token_id=None, pad_token_id=0)
        return generated[0, len(input_ids):].tolist(), len(input_ids)

    try:
        ttft, (tokens, prompt_tokens) = timed(first_token, args.repeat)
        print(f"transformers TTFT ms {[round(t, 1) for t in ttft]}; load {load_average()}", file=sys.stderr)
        pixel_values, grid = processed(path, image)
        pixel_values = pixel_values.to(model.dtype)
        with torch.inference_mode():
            encoder, _ = timed(lambda: model.model.visual(pixel_values, grid_thw=grid), args.repeat)
        print(f"transformers encoder ms {[round(t, 1) for t in encoder]}", file=sys.stderr)
        return dict(ttft_ms=ttft, encoder_ms=encoder, load_s=load_s, token=tokens[0], prompt_tokens=prompt_tokens,
                    dtype=args.dtype)
    finally:
        del model
        gc.collect()


# --- report ------------------------------------------------------------------------------------------------------

def spread(values: list[float], digits: int = 1) -> str:
    cell = f"{statistics.median(values):,.{digits}f}"
    return cell + (f" ({min(values):,.{digits}f}-{max(values):,.{digits}f})" if len(values) > 1 else "")


def table(results: dict, args) -> list[str]:
    lines = [f"| engine | dtype | TTFT ms (median of {args.repeat}, range) | encoder ms | encoder share | "
             "transformers' TTFT / this |", "|---|---|---:|---:|---:|---:|"]
    base = statistics.median(results[TRANSFORMERS]["ttft_ms"]) if TRANSFORMERS in results else None
    for name, r in results.items():
        ttft, encoder = statistics.median(r["ttft_ms"]), statistics.median(r["encoder_ms"])
        speedup = f"{base / ttft:.2f}x" if base else "n/a"
        lines.append(f"| {name} | {r['dtype']} | {spread(r['ttft_ms'])} | {spread(r['encoder_ms'])} | "
                     f"{encoder / ttft:.0%} | {speedup} |")
    return lines


def main(argv=None) -> None:
    args = parse_args(argv)
    flags = cpu_flags()
    record = Record("bench_vision", argv, machine_line("cpu", torch.get_num_threads()))
    scratch = tempfile.TemporaryDirectory(prefix="tpengine-vision-")
    if args.model:
        path, label = args.model, f"`{args.model}`"
    elif args.quick:
        path = write_checkpoint(os.path.join(scratch.name, "model"), QUICK_TEXT, QUICK_VISION, QUICK_PIXELS,
                                torch.bfloat16)
        label = "random-weight tiny Qwen2.5-VL (tests/models/vision.py's settings)"
    else:
        path = write_checkpoint(args.model_dir, QWEN2_5_VL_3B_TEXT, QWEN2_5_VL_3B_VISION, {}, torch.bfloat16)
        label = "random-weight Qwen2.5-VL-3B-Instruct shape"
    config = json.load(open(os.path.join(path, "config.json")))
    text, vision = config.get("text_config", config), config["vision_config"]
    image = random_image(args.image_size)
    ids = prompt_ids(path, config)
    _, grid = processed(path, image)
    results = {TPENGINE: measure_tpengine(path, ids, image, args)}
    if not args.skip_transformers:
        results[TRANSFORMERS] = measure_transformers(path, ids, image, args)
    fields = record.fields
    print(f"CPU flags: {flags}")
    print(f"command: `{fields['command']}`")
    print(f"machine: {fields['machine']}; CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"date {fields['date']}, tpengine revision {fields['revision']}, load average (1/5/15 min) "
          f"{fields['load_average_before']} before, {load_average()} after")
    r = results[TPENGINE]
    print(f"model: {label} ({path}): text hidden {text['hidden_size']}, {text['num_hidden_layers']} layers, vocab "
          f"{text['vocab_size']}; vision depth {vision['depth']}, hidden {vision['hidden_size']}")
    print(f"workload: one {args.image_size}x{args.image_size} image (grid {tuple(int(x) for x in grid[0])} patches, "
          f"{r['image_tokens']} image tokens), {r['prompt_tokens']}-token prompt, max_tokens 1 greedy, prefix caching "
          f"off; one warm-up then {args.repeat} timed runs per engine, engines one after the other; TTFT includes "
          "the image processor; encoder: the vision tower alone on the processed image")
    if TRANSFORMERS in results:
        same = results[TRANSFORMERS]["token"] == r["token"]
        print(f"first token: tpengine {r['token']}, transformers {results[TRANSFORMERS]['token']}"
              f" ({'same' if same else 'differs: random weights leave near-tied logits that rounding can flip'})")
    else:
        print("transformers skipped: --skip-transformers")
    print()
    print("\n".join(table(results, args)))
    record.write(args.json, cpu_flags=flags, model=dict(path=path, label=label, text_hidden=text["hidden_size"],
                                                        text_layers=text["num_hidden_layers"],
                                                        vision_depth=vision["depth"]),
                 dtype=args.dtype, image_size=args.image_size, grid=[int(x) for x in grid[0]], repeat=args.repeat,
                 engines={name: dict(r, ttft_median_ms=statistics.median(r["ttft_ms"]),
                                     encoder_median_ms=statistics.median(r["encoder_ms"]),
                                     encoder_share=statistics.median(r["encoder_ms"]) / statistics.median(r["ttft_ms"]))
                          for name, r in results.items()})
    scratch.cleanup()


if __name__ == "__main__":
    main()
