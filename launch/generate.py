"""Generate under torchrun: one process per rank, rank 0 schedules and samples, the others serve steps.

    torchrun --nproc-per-node 4 launch/generate.py --model PATH "prompt" ...

Multi-node: see launch/multinode.sh. Reads the variables torchrun sets: RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
"""
import argparse
import json
import logging
import sys

import torch.distributed as dist

from tpengine.distributed.parallel_state import init_torchrun_process_group


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="tpengine generation under torchrun (one process per rank)")
    parser.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt texts (rank 0 reads them)")
    parser.add_argument("--model", help="local Hugging Face checkpoint folder: Qwen3, Qwen3-MoE, Qwen2/2.5, "
                                        "Llama 3.x, Mistral (default: the embedded tiny model)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    parser.add_argument("--block-size", type=int, default=256, help="KV-cache block size in tokens")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="most tokens through one forward (default 2048 on the CPU, 16384 on CUDA)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="tpengine: %(message)s")
    init_torchrun_process_group(args.device)
    try:
        if dist.get_rank() != 0:
            from tpengine.runner.worker import torchrun_worker_main
            torchrun_worker_main()
            return 0
        from tpengine import LLM, SamplingParams
        from tpengine.tiny_model import default_model_path
        model = args.model or default_model_path()
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
        with LLM(model, tensor_parallel_size=dist.get_world_size(), device=args.device,
                 kvcache_block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens) as llm:
            prompts = args.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
            outputs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, out in zip(prompts, outputs):
            if args.json:
                print(json.dumps({"prompt": prompt, "text": out.text, "token_ids": out.token_ids,
                                  "prompt_token_ids": out.prompt_token_ids, "finish_reason": out.finish_reason}))
            else:
                print(f"Prompt: {prompt!r}\nOutput: {out.text!r}\n")
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
