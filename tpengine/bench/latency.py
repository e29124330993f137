"""`tpengine bench latency`: the seconds one batch of requests takes from submission to its last token.

As `vllm bench latency`: --batch-size prompts of --input-len random token ids each write exactly --output-len tokens
(ignore_eos, temperature 1.0) in one llm.generate; --num-iters-warmup untimed batches first, then --num-iters timed
ones. Prints the mean and the percentiles of the batch's latency; --output-json writes them with the run's record.
"""
import random
import statistics

from tpengine.bench.results import Record, machine_line
from tpengine.bench.timing import device_of, time_calls
from tpengine.bench.workload import random_prompts

PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_arguments(parser) -> None:
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens per request (default 32)")
    parser.add_argument("--output-len", type=int, default=128, help="tokens each request writes (default 128)")
    parser.add_argument("--batch-size", type=int, default=8, help="requests in the batch (default 8)")
    parser.add_argument("--num-iters-warmup", type=int, default=10, help="untimed batches first (default 10)")
    parser.add_argument("--num-iters", type=int, default=30, help="timed batches (default 30)")
    parser.add_argument("--output-json", metavar="PATH", help="also write the latencies to PATH as JSON")


def check_arguments(args) -> None:
    for flag in ("input_len", "output_len", "batch_size", "num_iters"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.num_iters_warmup < 0:
        raise ValueError(f"--num-iters-warmup must be at least 0, got {args.num_iters_warmup}")


def run(args, model: str, engine_kwargs: dict, argv: list[str] | None = None) -> int:
    import torch

    from tpengine import LLM, SamplingParams

    check_arguments(args)
    with LLM(model, **engine_kwargs) as llm:
        device = device_of(llm)
        record = Record("latency", argv, machine_line(device, torch.get_num_threads()), program="tpengine")
        prompts = random_prompts(random.Random(0), args.batch_size, args.input_len, llm.vocab_size)
        params = SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=args.output_len)
        seconds = time_calls(lambda: llm.generate(prompts, params, use_tqdm=False), args.num_iters_warmup,
                             args.num_iters, device)
    percentiles = {str(q): _percentile(seconds, q) for q in PERCENTILES}
    print(f"model {model}: batch {args.batch_size}, input {args.input_len}, output {args.output_len} tokens; "
          f"{args.num_iters} timed batches after {args.num_iters_warmup} untimed")
    print(f"Avg latency: {statistics.mean(seconds):.4f} seconds")
    for q, value in percentiles.items():
        print(f"{q}% percentile latency: {value:.4f} seconds")
    record.write(args.output_json, avg_latency=statistics.mean(seconds), latencies=seconds, percentiles=percentiles,
                 model=model, batch_size=args.batch_size, input_len=args.input_len, output_len=args.output_len)
    return 0


def _percentile(values: list[float], q: float) -> float:
    """numpy's default (linear) percentile, as vLLM reports it."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
