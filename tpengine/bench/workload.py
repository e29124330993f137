"""The benchmarks' requests: random token ids (no tokenizer needed), seeded, so every run and every engine gets
the same prompts."""
import random
from dataclasses import dataclass


def random_prompts(rng: random.Random, batch: int, length: int, vocab: int) -> list[list[int]]:
    """batch prompts of length token ids, each below vocab."""
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(batch)]


@dataclass(frozen=True)
class RandomWorkload:
    """nano-vllm's bench shape: num_seqs prompts of random token ids, input and output lengths drawn uniformly from
    their ranges (every request writes exactly its output length: ignore_eos)."""
    num_seqs: int
    min_input_len: int
    max_input_len: int
    min_output_len: int
    max_output_len: int

    def draw(self, vocab_size: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
        """(prompts, output lengths); token ids below min(vocab_size, 10000), as nano-vllm draws them."""
        rng = random.Random(seed)
        high = min(vocab_size, 10000) - 1
        prompts = [[rng.randint(0, high) for _ in range(rng.randint(self.min_input_len, self.max_input_len))]
                   for _ in range(self.num_seqs)]
        output_lens = [rng.randint(self.min_output_len, self.max_output_len) for _ in range(self.num_seqs)]
        return prompts, output_lens


# nano-vllm's bench on CUDA (its 256 requests of 100..1024 in and out); a CPU run of minutes; a --quick run
NANO_VLLM = {"cpu": RandomWorkload(64, 16, 256, 16, 128), "cuda": RandomWorkload(256, 100, 1024, 100, 1024)}
QUICK = RandomWorkload(6, 4, 24, 2, 8)


def warm_up_workload(prompts: list[list[int]], output_lens: list[int]) -> list[tuple[list[list[int]], list[int]]]:
    """Two small batches shaped like the timed run, so nothing compiles inside it: prefill steps of two
    sizes with several sequences each (torch.compile turns the token dimension dynamic after its second
    size), decode batches shrinking one sequence a step down to 1 (the sampler compiles per batch size
    the same way; 1 is a size of its own). The prompts are the workload's own, reversed: the same
    lengths, and no block in common with the timed prompts, so the timed run gets no prefix-cache hit."""
    batches, start = [], 0
    for num_seqs in (8, 3):
        chosen = prompts[start:start + num_seqs] or prompts[:1]
        batches.append(([p[::-1] for p in chosen], [min(2 + 2 * i, max(output_lens)) for i in range(len(chosen))]))
        start += num_seqs
    return batches


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank q-th percentile (nan for no values)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))] if ordered else float("nan")
