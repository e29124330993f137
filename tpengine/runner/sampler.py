"""Token sampling on rank 0: greedy, temperature, top-k, top-p, min-p, and per-request seeds."""
import torch

from tpengine.layers.compile import compiled_on_cuda
from tpengine.sampling_params import SamplingParams

_SEED_STRIDE = 0x9E3779B97F4A7C15  # golden-ratio step: spreads (seed, position) over the seed space


def _noise_generator(seed: int, position: int, device: torch.device) -> torch.Generator:
    # Stateless: a seeded request's draw depends only on its seed and how many tokens it has,
    # so its tokens are the same whatever else shares the batch, and after a preemption.
    return torch.Generator(device).manual_seed((seed * _SEED_STRIDE + position) % (1 << 63))


class Sampler:
    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> list[int]:
        """logits: [batch, vocab]; positions[i]: how many tokens sequence i has (keys its seeded draw)."""
        logits = logits.float()
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if not random_rows:
            return logits.argmax(dim=-1).tolist()
        if len(random_rows) == len(params):
            return self._draw(logits, params, positions)
        greedy_rows = [i for i, p in enumerate(params) if p.is_greedy]
        token_ids = [0] * len(params)
        for rows, ids in (
            (greedy_rows, self._rows(logits, greedy_rows).argmax(dim=-1).tolist()),
            (random_rows, self._draw(self._rows(logits, random_rows), [params[i] for i in random_rows],
                                     [positions[i] for i in random_rows])),
        ):
            for i, token in zip(rows, ids):
                token_ids[i] = token
        return token_ids

    @staticmethod
    def _rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        return logits[torch.tensor(rows, device=logits.device)]

    def _draw(self, logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> list[int]:
        """One token per row from its filtered distribution, by inverse CDF: one uniform draw per row
        picks the token whose slice of the cumulative distribution holds it. float64 keeps the slices
        of unlikely tokens exact over a large vocabulary. (An exponential race needs a draw per
        vocabulary entry: 13x the time on the CPU, docs/benchmarks.md.)"""
        device = logits.device
        cdf = self._filtered_probs(logits, params).cumsum(dim=-1, dtype=torch.float64)
        uniform = torch.rand(len(params), 1, dtype=torch.float64, device=device)
        for row, (p, position) in enumerate(zip(params, positions)):
            if p.seed is not None:  # its own stream: the same tokens whatever else is in the batch
                uniform[row] = torch.rand(1, dtype=torch.float64, device=device,
                                          generator=_noise_generator(p.seed, position, device))
        # right side: the first token whose cumulative mass exceeds the draw, so a token filtered
        # to probability 0 (an empty slice) is never picked
        picked = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).clamp_(max=cdf.size(1) - 1)
        return picked.squeeze(1).tolist()

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        # Which limits any row sets is decided here, in Python: no tensor work for an unused filter,
        # and no data-dependent branch inside the compiled math.
        device = logits.device
        temperatures = torch.tensor([p.temperature for p in params], device=device)
        top_ks = top_ps = min_ps = None
        if any(p.top_k != -1 for p in params):
            vocab = logits.size(1)
            top_ks = torch.tensor([vocab if p.top_k == -1 else min(p.top_k, vocab) for p in params], device=device)
        if any(p.top_p < 1.0 for p in params):
            top_ps = torch.tensor([p.top_p for p in params], device=device)
        if any(p.min_p > 0.0 for p in params):
            min_ps = torch.tensor([p.min_p for p in params], device=device)
        return filtered_probs(logits, temperatures, top_ks, top_ps, min_ps)


@compiled_on_cuda
def filtered_probs(logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor | None,
                   top_ps: torch.Tensor | None, min_ps: torch.Tensor | None) -> torch.Tensor:
    """Each row's distribution after temperature, top-k, top-p and min-p; a limit is None when no row sets it."""
    logits = logits / temperatures.unsqueeze(1)
    if top_ks is not None:
        kth = logits.sort(dim=-1, descending=True).values.gather(1, (top_ks - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    if top_ps is not None:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # drop a token when the tokens before it already cover top_p; the first always stays
        drop_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_ps.unsqueeze(1)
        probs = probs.masked_fill(drop_sorted.scatter(1, order, drop_sorted), 0.0)
    if min_ps is not None:
        threshold = min_ps.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs
