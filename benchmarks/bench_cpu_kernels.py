"""The CPU fast paths against what they replaced, in one run: decode attention, linears, sampling.

1. Paged decode attention: the C++ kernel (the `cpu` backend) against the `torch` backend's
   loop over sequences, on a decode batch with contexts drawn from --min-context..--max-context.
2. Linear layers: matmuls on oneDNN-packed weights against F.linear, for the projections of the
   bench.py CPU model (hidden 512, 8 layers, intermediate 1536, vocab 16384; --quick: bench.py's
   QUICK_MODEL). All layers' weights are cycled, as in a forward pass, so they come from memory
   rather than a warm cache.
   The same in bfloat16: oneDNN-packed against tpengine's AVX512-BF16 kernel (kernels/cpu/bf16_linear.cpp).
3. Sampling one token per row from the logits: the inverse-CDF draw in torch (the sampler's torch
   path) and in C++ (kernels/cpu/sampling.cpp, the CPU's path for rows a temperature alone shapes),
   against the exponential race (argmax of p / E, one Exp(1) draw per vocabulary entry) used before.
4. Rotary, eager: the CPU form (each half written in place into one output) against the form CUDA
   compiles (broadcast elementwise ops that torch.compile traces as one graph), for q and k of the
   bench model's shape (8 heads, 4 KV heads of 64) at --rows tokens.
5. Quantized linears (kernels/cpu/quant_linear.cpp): int8 per output channel and int4 in groups of 128, each with
   int8 activations (quantized per token on the fly) and float ones, against the float32 oneDNN-packed linear
   (and bfloat16 where this CPU packs it), on Qwen3-0.6B's projections (qkv 4096x1024, o 1024x2048, gate_up
   6144x1024, down 1024x3072; two layers, so they come from memory) and its LM head (151936x1024) apart;
   --quick: QUICK_MODEL's. G MAC/s and GB/s (resident weight bytes read per second) per form.

    .venv/bin/python benchmarks/bench_cpu_kernels.py
    .venv/bin/python benchmarks/bench_cpu_kernels.py --sections bf16-linears --rows 1 4 16 2048
    .venv/bin/python benchmarks/bench_cpu_kernels.py --sections quant --rows 1 4 16 64
    .venv/bin/python benchmarks/bench_cpu_kernels.py --quick      # seconds: small batch, rows 1 4, QUICK_MODEL's linears
"""
import argparse
import random
import time

import torch
import torch.nn.functional as F

from tpengine.bench.models import CPU_MODEL, QUICK_MODEL
from tpengine.bench.quick import parse_with_quick
from tpengine.attention.backend import AttentionParams
from tpengine.attention.metadata import AttentionMetadata
from tpengine.attention.torch_backend import TorchAttentionBackend
from tpengine.hf_config import RopeParameters
from tpengine.kernels.cpu import quant_linear as cpu_quant
from tpengine.kernels.cpu import sampling as cpu_sampling
from tpengine.kernels.cpu.paged_decode_attention import paged_decode_attention
from tpengine.layers.rotary_embedding import RotaryEmbedding
from tpengine.platforms.cpu import Bf16Blocks, linear, pack_linear_weight
from tpengine.platforms.torch_ops import apply_rotary_in_halves, apply_rotary_pointwise
from tpengine.runner.sampler import filtered_probs


def best_ms(fn, repeat: int, rounds: int) -> float:
    """Fastest of `rounds` rounds of `repeat` calls, in ms per call."""
    fn()
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(repeat):
            fn()
        times.append((time.perf_counter() - started) / repeat)
    return min(times) * 1e3


def decode_attention(args) -> None:
    print(f"\n## Paged decode attention: {args.batch} sequences, contexts {args.min_context}..{args.max_context}, "
          "8 heads / 4 KV heads of 64, float32\n")
    print("| block size | torch backend ms | C++ kernel ms | speed-up |\n|---:|---:|---:|---:|")
    rng = random.Random(0)
    heads, kv_heads, head_dim = 8, 4, 64
    for block_size in (16, 256):
        lens = [rng.randint(args.min_context, args.max_context) for _ in range(args.batch)]
        num_blocks = sum(-(-n // block_size) for n in lens) + 1
        physical = list(range(num_blocks))
        rng.shuffle(physical)
        tables = [[physical.pop() for _ in range(-(-n // block_size))] for n in lens]
        width = max(map(len, tables))
        k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim)
        v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim)
        q = torch.randn(args.batch, heads, head_dim)
        meta = AttentionMetadata(
            is_prefill=False, slot_mapping=torch.zeros(args.batch, dtype=torch.long),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            block_tables_list=tables, seqlens_k=lens, context_lens=torch.tensor(lens, dtype=torch.int32))
        params = AttentionParams(head_dim**-0.5)
        torch_ms = best_ms(lambda: TorchAttentionBackend().decode(q, k_cache, v_cache, meta, params), 10,
                           args.rounds)
        kernel_ms = best_ms(lambda: paged_decode_attention(q, k_cache, v_cache, meta.block_tables,
                                                           meta.context_lens, head_dim**-0.5), 10, args.rounds)
        print(f"| {block_size} | {torch_ms:.2f} | {kernel_ms:.2f} | {torch_ms / kernel_ms:.1f}x |")


def layer_weights(model: dict) -> list[torch.Tensor]:
    """Every decoder layer's q/k/v, o, gate/up and down projection weights, in a forward's order."""
    hidden, intermediate = model["hidden_size"], model["intermediate_size"]
    q, kv = model["num_attention_heads"] * model["head_dim"], model["num_key_value_heads"] * model["head_dim"]
    shapes = [(q + 2 * kv, hidden), (hidden, q), (2 * intermediate, hidden), (hidden, intermediate)]
    return [torch.randn(out, inp) * 0.02 for _ in range(model["num_hidden_layers"]) for out, inp in shapes]


def linears(args) -> None:
    model = args.model_shape
    print(f"\n## Linear layers: {model['num_hidden_layers']} layers of qkv, o, gate_up, down, then the LM head; "
          "ms per forward\n")
    print("| rows | F.linear ms | packed ms | speed-up | LM head F.linear ms | LM head packed ms |\n"
          "|---:|---:|---:|---:|---:|---:|")
    hidden = model["hidden_size"]
    weights = layer_weights(model)
    packed = [pack_linear_weight(w) for w in weights]
    head = torch.randn(model["vocab_size"], hidden) * 0.02
    head_packed = pack_linear_weight(head)
    if head_packed is None:
        print("this torch has no oneDNN weight packing: nothing to compare")
        return
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k) for k in {w.size(1) for w in weights}}

        def layers(use_packed: bool):
            for w, p in zip(weights, packed):
                linear(inputs[w.size(1)], w, None, p if use_packed else None)

        repeat = max(1, 200 // rows)
        plain_ms = best_ms(lambda: layers(False), repeat, args.rounds)
        packed_ms = best_ms(lambda: layers(True), repeat, args.rounds)
        x = inputs[hidden]
        head_plain = best_ms(lambda: F.linear(x, head), repeat, args.rounds)
        head_fast = best_ms(lambda: linear(x, head, None, head_packed), repeat, args.rounds)
        print(f"| {rows} | {plain_ms:.2f} | {packed_ms:.2f} | {plain_ms / packed_ms:.2f}x | "
              f"{head_plain:.2f} | {head_fast:.2f} |")


def bf16_linears(args) -> None:
    print("\n## bfloat16 linears: the same layers and LM head, float32 packed (oneDNN), bfloat16 packed by "
          "oneDNN, bfloat16 on tpengine's AVX512-BF16 kernel; ms per forward\n")
    model = args.model_shape
    weights = layer_weights(model) + [torch.randn(model["vocab_size"], model["hidden_size"])]
    halves = [w.bfloat16() for w in weights]
    ours = [pack_linear_weight(w) for w in halves]
    if not isinstance(ours[0], Bf16Blocks):  # checked first: oneDNN's bfloat16 packing needs AVX512 too
        print("this CPU has no AVX512-BF16 (or no compiler): nothing to compare")
        return
    forms = {"float32 oneDNN": (weights, [pack_linear_weight(w) for w in weights]),
             "bfloat16 oneDNN": (halves, [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in halves]),
             "bfloat16 tpengine": (halves, ours)}
    print("| rows | " + " | ".join(f"{name} ms" for name in forms) + " | tpengine vs oneDNN bfloat16 |\n"
          "|---:|" + "---:|" * (len(forms) + 1))
    for rows in args.rows:
        inputs = {(dtype, k): torch.randn(rows, k, dtype=dtype) for dtype in (torch.float32, torch.bfloat16)
                  for k in {w.size(1) for w in weights}}

        def forward(ws, ps):
            for w, p in zip(ws, ps):
                linear(inputs[w.dtype, w.size(1)], w, None, p)

        times = [best_ms(lambda: forward(*form), max(1, 200 // rows), args.rounds) for form in forms.values()]
        print(f"| {rows} | " + " | ".join(f"{t:.2f}" for t in times) + f" | {times[1] / times[2]:.2f}x |")


def sampling(args) -> None:
    print(f"\n## Sampling one token per row: {args.batch} rows x {args.vocab} vocabulary, temperature 0.6, "
          "from the logits\n")
    logits = torch.randn(args.batch, args.vocab) * 3
    temperatures = torch.full((args.batch,), 0.6)

    def exponential_race():
        probs = filtered_probs(logits, temperatures, None, None, None)
        return (probs / torch.empty_like(probs).uniform_().log_().neg_()).argmax(dim=-1)

    def inverse_cdf():  # the sampler's torch path
        cdf = filtered_probs(logits, temperatures, None, None, None).cumsum(dim=-1, dtype=torch.float64)
        uniform = torch.rand(args.batch, 1, dtype=torch.float64)
        return torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True)

    def kernel():  # the same draw in C++ (kernels/cpu/sampling.cpp), no cumulative sum written out
        return cpu_sampling.sample_rows(logits, temperatures, torch.rand(args.batch, dtype=torch.float64))

    race_ms, cdf_ms = best_ms(exponential_race, 20, args.rounds), best_ms(inverse_cdf, 20, args.rounds)
    kernel_ms = best_ms(kernel, 20, args.rounds) if cpu_sampling.available() else float("nan")
    print("| exponential race ms | inverse CDF in torch ms | inverse CDF in C++ ms | C++ vs torch |\n|---:|---:|---:|---:|")
    print(f"| {race_ms:.2f} | {cdf_ms:.2f} | {kernel_ms:.2f} | {cdf_ms / kernel_ms:.1f}x |")


def rotary(args) -> None:
    print("\n## Rotary on q and k, eager: in-place halves (CPU) vs the form CUDA compiles\n")
    print("| tokens | in-place ms | CUDA form ms | CUDA form / in-place |\n|---:|---:|---:|---:|")
    cache = RotaryEmbedding(64, 4096, RopeParameters(theta=1_000_000.0)).cos_sin_cache
    for rows in args.rows:
        positions = torch.randint(0, 4096, (rows,))
        qkv = torch.randn(rows, (8 + 2 * 4) * 64)
        q, k = qkv[:, :512].view(rows, 8, 64), qkv[:, 512:768].view(rows, 4, 64)  # strided, as the model's
        repeat = max(1, 2000 // rows)
        in_place_ms = best_ms(lambda: apply_rotary_in_halves(positions, q, k, cache), repeat, args.rounds)
        cuda_ms = best_ms(lambda: apply_rotary_pointwise(positions, q, k, cache), repeat, args.rounds)
        print(f"| {rows} | {in_place_ms:.3f} | {cuda_ms:.3f} | {cuda_ms / in_place_ms:.2f}x |")


QWEN3_0_6B = dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, num_hidden_layers=2, vocab_size=151936)


def quantized(weight: torch.Tensor, bits: int, group_size: int, activation: str) -> "cpu_quant.PackedQuantWeight":
    """weight rounded to bits, symmetric, one scale per group of group_size columns, packed for the kernel."""
    out_features, in_features = weight.shape
    groups = weight.view(out_features, in_features // group_size, group_size)
    scales = groups.abs().amax(dim=2) / (2 ** (bits - 1) - 1)
    qweight = (groups / scales[..., None]).round().clamp(-2 ** (bits - 1), 2 ** (bits - 1) - 1).to(torch.int8)
    return cpu_quant.pack(qweight.view(out_features, in_features), scales, None, bits, group_size, activation)


def quant_linears(args) -> None:
    model = args.model_shape if args.quick else QWEN3_0_6B
    print(f"\n## Quantized linears: {model['num_hidden_layers']} layers of qkv, o, gate_up, down, and the LM head apart; "
          "ms per forward, G MAC/s, GB/s of resident weight\n")
    if not cpu_quant.available():
        print("the quantized linear does not build here: nothing to compare")
        return
    layers = layer_weights(model)
    head = [torch.randn(model["vocab_size"], model["hidden_size"]) * 0.02]
    formats = [("int8 per channel", 8, None), ("int4 groups of 128", 4, 128)]
    print("| rows | weights | form | ms | G MAC/s | GB/s | vs float32 |\n|---:|---|---|---:|---:|---:|---:|")
    for name, weights in (("layers", layers), ("LM head", head)):
        forms = {"float32 oneDNN": (weights, [pack_linear_weight(w) for w in weights])}
        halves = [w.bfloat16() for w in weights]
        halves_packed = [pack_linear_weight(w) for w in halves]
        if all(p is not None for p in halves_packed):  # this CPU packs bfloat16 (oneDNN or tpengine's kernel)
            forms["bfloat16 packed"] = (halves, halves_packed)
        for label, bits, group_size in formats:
            for activation in cpu_quant.ACTIVATIONS:
                packs = [quantized(w, bits, min(group_size or w.size(1), w.size(1)), activation) for w in weights]
                forms[f"{label}, {activation} activations"] = (weights, packs)
        macs = sum(w.numel() for w in weights)
        for rows in args.rows:
            inputs = {(dtype, k): torch.randn(rows, k, dtype=dtype) for dtype in (torch.float32, torch.bfloat16)
                      for k in {w.size(1) for w in weights}}

            def forward(ws, ps):
                for w, p in zip(ws, ps):
                    if isinstance(p, cpu_quant.PackedQuantWeight):
                        cpu_quant.quant_linear(inputs[torch.float32, p.in_features], p)
                    else:
                        linear(inputs[w.dtype, w.size(1)], w, None, p)

            float32_ms = None
            for form, (ws, ps) in forms.items():
                ms = best_ms(lambda: forward(ws, ps), max(1, 64 // rows), args.rounds)
                float32_ms = float32_ms or ms
                resident = sum(p.resident_bytes() if isinstance(p, cpu_quant.PackedQuantWeight)
                               else w.numel() * w.element_size() for w, p in zip(ws, ps))
                print(f"| {rows} | {name} | {form} | {ms:.3f} | {macs * rows / ms / 1e6:.1f} | "
                      f"{resident / ms / 1e6:.1f} | {float32_ms / ms:.2f}x |")


SECTIONS = {"attention": decode_attention, "linears": linears, "bf16-linears": bf16_linears, "sampling": sampling,
            "rotary": rotary, "quant": quant_linears}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--min-context", type=int, default=16)
    p.add_argument("--max-context", type=int, default=384)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 2048])
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per measurement, the fastest kept (default 5)")
    args = parse_with_quick(p, argv, dict(batch=4, min_context=8, max_context=64, rows=[1, 4], vocab=2048, rounds=1),
                            "the linears of tpengine.bench's QUICK_MODEL")
    args.model_shape = QUICK_MODEL if args.quick else CPU_MODEL
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name in args.sections:
        SECTIONS[name](args)


if __name__ == "__main__":
    main()
