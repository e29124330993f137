"""`tpengine bench throughput`: requests and tokens a second of offline generation over many requests.

As `vllm bench throughput` on its random dataset: --num-prompts prompts of --input-len random token ids each write
exactly --output-len tokens (ignore_eos, temperature 1.0), all given to one llm.generate. A warm-up on two small
batches shaped like the run comes first (timing.time_generate), so torch.compile builds nothing inside the timed
window. Prints requests/s, total tokens/s and output tokens/s; --output-json writes them with the run's record.
"""
import random

from tpengine.bench.results import Record, machine_line
from tpengine.bench.timing import device_of, time_generate
from tpengine.bench.workload import random_prompts


def add_arguments(parser) -> None:
    parser.add_argument("--input-len", type=int, default=1024, help="prompt tokens per request (default 1024)")
    parser.add_argument("--output-len", type=int, default=128, help="tokens each request writes (default 128)")
    parser.add_argument("--num-prompts", type=int, default=1000, help="requests (default 1000)")
    parser.add_argument("--seed", dest="workload_seed", type=int, default=0, metavar="SEED",
                        help="the random prompts' seed (default 0)")
    parser.add_argument("--output-json", metavar="PATH", help="also write the figures to PATH as JSON")


def run(args, model: str, engine_kwargs: dict, argv: list[str] | None = None) -> int:
    import torch

    from tpengine import LLM

    for flag in ("input_len", "output_len", "num_prompts"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    with LLM(model, **engine_kwargs) as llm:
        device = device_of(llm)
        record = Record("throughput", argv, machine_line(device, torch.get_num_threads()), program="tpengine")
        prompts = random_prompts(random.Random(args.workload_seed), args.num_prompts, args.input_len, llm.vocab_size)
        output_lens = [args.output_len] * args.num_prompts
        seconds, compiled = time_generate(llm, prompts, output_lens, temperature=1.0, device=device)
    prompt_tokens, output_tokens = args.num_prompts * args.input_len, sum(output_lens)
    figures = dict(elapsed_time=seconds, num_requests=args.num_prompts, total_num_tokens=prompt_tokens + output_tokens,
                   total_output_tokens=output_tokens, requests_per_second=args.num_prompts / seconds,
                   tokens_per_second=(prompt_tokens + output_tokens) / seconds,
                   output_tokens_per_second=output_tokens / seconds)
    print(f"model {model}: {args.num_prompts} requests, input {args.input_len}, output {args.output_len} tokens")
    print(f"Throughput: {figures['requests_per_second']:.2f} requests/s, {figures['tokens_per_second']:.2f} total "
          f"tokens/s, {figures['output_tokens_per_second']:.2f} output tokens/s")
    print(f"Total num prompt tokens: {prompt_tokens}")
    print(f"Total num output tokens: {output_tokens}")
    if device == "cuda":
        print(f"graphs torch.compile built inside the timed run: {'n/a' if compiled is None else compiled}")
    record.write(args.output_json, model=model, input_len=args.input_len, output_len=args.output_len, **figures)
    return 0
