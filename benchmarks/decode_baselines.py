"""Other engines' decode step on the same checkpoint, for benchmarks/bench_low_batch.py's curve over batch sizes.

Each baseline measures, for every batch size asked, the ms of one decode step of `batch` sequences whose prompts
are `context_len` random tokens (greedy, every sequence writes all its tokens), and is told nothing of tpengine:

- transformers: `model.generate` of the batch (all prompts one length, so no padding) writing 1 token, then
  writing 1 + steps tokens, fresh prompts each; a step is the difference over `steps`. In this process.
- llama.cpp: `llama-batched-bench -npp context_len -ntg steps -npl B1,B2,... -pps` on a GGUF of the same weights
  (../shared/bench/llamacpp/README.md builds it and converts the checkpoint); a step is B / its S_TG column.
  -pps prefills the prompt once and copies its KV to every sequence (each keeps its own copy: -no-kvu), so the
  untimed prefill costs one prompt, not B; the decode steps read as much KV as with B prompts.
- vLLM: its offline `LLM` (vLLM's CPU build, its own venv) in a child process running benchmarks/vllm_decode.py,
  the same difference of two generate calls as for transformers; the child stays up between rounds.

None of them runs in tests or CI except through a stand-in (tests/benchmarks): they are anchors for docs/benchmarks.md.
"""
import json
import os
import random
import re
import subprocess
import sys
import time

from tpengine.bench.workload import random_prompts

BENCHMARKS = os.path.dirname(os.path.abspath(__file__))


class TransformersDecode:
    """transformers' generate, greedy, on the checkpoint in the run's dtype, on this process's torch threads."""

    def __init__(self, model_path: str, dtype: str, context_len: int, steps: int, seed: int = 1):
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
        self.model.generation_config.eos_token_id = None  # nothing may end a sequence early
        self.vocab = self.model.config.vocab_size
        self.context_len, self.steps, self.rng = context_len, steps, random.Random(seed)
        self.label = f"transformers generate ({dtype})"
        self._generate(1, 2)  # warm-up

    def _generate(self, batch: int, new_tokens: int) -> float:
        input_ids = self.torch.tensor(random_prompts(self.rng, batch, self.context_len, self.vocab))
        with self.torch.inference_mode():
            started = time.perf_counter()
            out = self.model.generate(input_ids=input_ids, attention_mask=self.torch.ones_like(input_ids),
                                      max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                      pad_token_id=0, eos_token_id=None, use_cache=True)
            elapsed = time.perf_counter() - started
        assert out.shape == (batch, self.context_len + new_tokens), "transformers stopped early"
        return elapsed

    def step_ms(self, batch_sizes: list[int]) -> dict[int, float]:
        result = {}
        for batch in batch_sizes:
            first = self._generate(batch, 1)
            whole = self._generate(batch, 1 + self.steps)
            result[batch] = (whole - first) / self.steps * 1e3
        return result

    def close(self) -> None:
        del self.model


# llama-batched-bench's table rows: |  PP |  TG |  B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
BATCHED_BENCH_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|" + r"\s*([\d.]+)\s*\|" * 6)


def parse_batched_bench(text: str) -> dict[int, dict[str, float]]:
    """llama-batched-bench's markdown rows by batch: prompt, decode and total tok/s and seconds."""
    rows = {}
    for line in text.splitlines():
        match = BATCHED_BENCH_ROW.match(line.strip())
        if match:
            pp, tg, batch, _, t_pp, s_pp, t_tg, s_tg, t, s = match.groups()
            rows[int(batch)] = dict(prompt=int(pp), decode_steps=int(tg), prefill_s=float(t_pp),
                                    prefill_tok_s=float(s_pp), decode_s=float(t_tg), decode_tok_s=float(s_tg),
                                    total_s=float(t), total_tok_s=float(s))
    return rows


class LlamaCppDecode:
    """llama.cpp's llama-batched-bench on one GGUF file, 2 threads by default, `-fa off -no-kvu` (fastest here),
    the prompt shared (-pps)."""

    def __init__(self, bin_dir: str, name: str, gguf: str, context_len: int, steps: int, threads: int,
                 extra: tuple[str, ...] = ()):
        self.binary = os.path.join(bin_dir, "llama-batched-bench")
        if not os.access(self.binary, os.X_OK):
            raise SystemExit(f"no llama-batched-bench in {bin_dir}: see ../shared/bench/llamacpp/README.md")
        self.gguf, self.context_len, self.steps, self.threads, self.extra = gguf, context_len, steps, threads, extra
        self.label = f"llama.cpp {name}"

    def command(self, batch_sizes: list[int]) -> list[str]:
        n_ctx = max(batch_sizes) * (self.context_len + self.steps + 16)
        return [self.binary, "-m", self.gguf, "-c", str(n_ctx), "-b", "2048", "-ub", "512",
                "-npp", str(self.context_len), "-ntg", str(self.steps), "-npl", ",".join(map(str, batch_sizes)),
                "-t", str(self.threads), "-fa", "off", "-no-kvu", "-pps", *self.extra]

    def step_ms(self, batch_sizes: list[int]) -> dict[int, float]:
        result = subprocess.run(self.command(batch_sizes), capture_output=True, text=True, timeout=3600)
        rows = parse_batched_bench(result.stdout)
        if result.returncode != 0 or set(rows) != set(batch_sizes):
            raise SystemExit(f"llama-batched-bench failed ({result.returncode}):\n{result.stdout[-2000:]}"
                             f"{result.stderr[-2000:]}")
        return {batch: batch / rows[batch]["decode_tok_s"] * 1e3 for batch in batch_sizes}

    def close(self) -> None:
        pass


class VllmDecode:
    """vLLM's offline LLM in a child process (its venv's python running benchmarks/vllm_decode.py), kept up."""

    def __init__(self, python: str, model_path: str, dtype: str, context_len: int, steps: int,
                 batch_sizes: list[int]):
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
        venv = os.path.dirname(os.path.dirname(os.path.abspath(python)))
        preload = ["/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", os.path.join(venv, "lib", "libiomp5.so")]
        if all(os.path.exists(path) for path in preload):  # as ../shared/bench/vllm-cpu/README.md runs it
            env["LD_PRELOAD"] = ":".join(preload)
        command = [python, os.path.join(BENCHMARKS, "vllm_decode.py"), model_path, "--dtype", dtype,
                   "--context-len", str(context_len), "--steps", str(steps),
                   "--batch-sizes", *map(str, batch_sizes)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        ready = self._answer()
        bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")  # its default computes on one core, leaving one free
        self.label = f"vLLM {ready['version']} offline LLM ({dtype}{', threads bound to ' + bind if bind else ''})"

    def _answer(self) -> dict:
        """The child's next protocol line (marked @@); whatever else vLLM prints on stdout goes to stderr."""
        for line in self.process.stdout:
            if line.startswith("@@ "):
                return json.loads(line[3:])
            sys.stderr.write(line)
        raise SystemExit(f"vLLM's child exited ({self.process.wait()}); its stderr is above")

    def step_ms(self, batch_sizes: list[int]) -> dict[int, float]:
        self.process.stdin.write(" ".join(map(str, batch_sizes)) + "\n")
        self.process.stdin.flush()
        return {int(batch): ms for batch, ms in self._answer()["step_ms"].items()}

    def close(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def parse_gguf(values: list[str]) -> list[tuple[str, str]]:
    """--gguf NAME=PATH ... as (name, path) pairs."""
    pairs = []
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--gguf wants NAME=PATH (e.g. f32=model-f32.gguf), got {value!r}")
        pairs.append((name, path))
    return pairs


if __name__ == "__main__":
    sys.exit("decode_baselines.py is a module of benchmarks/bench_low_batch.py")
