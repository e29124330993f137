"""vLLM's decode step by batch size, offline: run by vLLM's own python for benchmarks/decode_baselines.py.

    ~/.cache/vllm-cpu-anchor/bin/python benchmarks/vllm_decode.py MODEL_DIR --batch-sizes 1 4 16 64

Builds vLLM's offline LLM on the checkpoint (no tokenizer needed: prompts are token ids; prefix caching off; one
prefill step holds the largest batch's prompts), warms every batch size up, prints one line
`@@ {"version": ...}`, then answers each line of batch sizes on stdin with `@@ {"step_ms": {batch: ms}}`
(vLLM may print on stdout too: the reader takes only the lines marked @@). A step is
(generate writing 1 + steps tokens - generate writing 1 token) / steps, fresh random prompts each call,
greedy, ignore_eos. Imports nothing of tpengine: it runs in vLLM's venv.
"""
import argparse
import json
import random
import sys
import time

MARK = "@@"  # the protocol's lines; anything else on stdout is vLLM's


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--context-len", type=int, default=208)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--seed", type=int, default=2)
    args = p.parse_args()

    import vllm
    from vllm import LLM, SamplingParams

    max_batch = max(args.batch_sizes)
    llm = LLM(args.model, dtype=args.dtype, skip_tokenizer_init=True, enable_prefix_caching=False, seed=0,
              max_model_len=args.context_len + args.steps + 16, max_num_seqs=max_batch,
              max_num_batched_tokens=max(2048, max_batch * args.context_len))
    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng = random.Random(args.seed)

    def generate(batch: int, new_tokens: int) -> float:
        prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(args.context_len)]} for _ in range(batch)]
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True,
                                detokenize=False)
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        assert all(len(out.outputs[0].token_ids) == new_tokens for out in outputs), "vLLM wrote other lengths"
        return elapsed

    def step_ms(batch: int) -> float:
        first = generate(batch, 1)
        return (generate(batch, 1 + args.steps) - first) / args.steps * 1e3

    for batch in args.batch_sizes:  # warm-up: every shape once
        generate(batch, 3)
    print(MARK, json.dumps({"version": vllm.__version__}), flush=True)
    for line in sys.stdin:
        batches = [int(b) for b in line.split()]
        print(MARK, json.dumps({"step_ms": {batch: step_ms(batch) for batch in batches}}), flush=True)


if __name__ == "__main__":
    main()
