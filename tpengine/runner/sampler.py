"""Token sampling: penalties, min_tokens, greedy or filtered sampling, logprobs, and seeds.

Rank 0 samples the gathered logits. On the CPU, rows that a temperature alone shapes go through the
C++ kernel (kernels/cpu/sampling.cpp), and at tp > 1 a step made only of such rows is sampled by every
rank over its own slice of the vocabulary instead (`sample_vocab_parallel`: no gather of the logits),
with the same arithmetic, so either path gives a row the same token.

Per step the host sends the device only small tensors, each by one pinned non-blocking copy (the
random numbers included: they are drawn on the host), and waits on the device once, for the result.
"""
import math
from typing import NamedTuple

import torch

from tpengine.distributed.messages import VocabParallelSampling
from tpengine.kernels.cpu import sampling as cpu_sampling
from tpengine.platforms.cuda import compiled_on_cuda
from tpengine.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingRecord

_SEED_STRIDE = 0x9E3779B97F4A7C15  # golden-ratio step: spreads (seed, position) over the seed space
_MASK64 = (1 << 64) - 1


def seeded_uniform(seed: int, position: int) -> float:
    """A uniform draw in [0, 1) that depends only on (seed, position): a seeded request gets the same
    tokens whatever shares its batch, after a preemption, and on any device (splitmix64 on the host)."""
    z = (seed * _SEED_STRIDE + position) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((z ^ (z >> 31)) >> 11) * (1.0 / (1 << 53))


class SamplerOutput(NamedTuple):
    token_ids: list[int]                          # -1 for a row with no finite distribution (NaN logits)
    logprobs: list[dict[int, float] | None]       # per row: token id -> log-probability, None unless asked
    # the verify rows' drafts that a draft model proposed on the ranks this step, row after row
    draft_token_ids: list[int] = []
    # embedding requests whose prompts ran to their ends this step: sequence id -> pooled vector (runner/pooler.py)
    pooled: dict[int, list[float]] = {}
    # prompt logprobs computed this step: sequence id -> (first position scored, each position's entry)
    prompt_logprobs: dict[int, tuple] = {}


def _to_device(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.tensor(data, dtype=dtype)
    return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max(1, max(map(len, rows)))
    return _to_device([row + [pad] * (width - len(row)) for row in rows], torch.int64, device)


class Sampler:
    def __init__(self, seed: int | None = None, num_vocab_slices: int = 1):
        # Unseeded sampled rows draw from this host generator: the engine's seed makes a run repeatable.
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        # the tensor-parallel size: the CPU kernel cuts gathered logits into the slices the ranks hold,
        # so a row gets the token the ranks would sample without gathering (vocab_parallel_rows)
        self.num_vocab_slices = num_vocab_slices

    def vocab_parallel_rows(self, records: list[SamplingRecord], vocab_size: int) -> VocabParallelSampling:
        """Each row's temperature and uniform, and the token masks of the rows a grammar constrains, for every
        rank to sample its own slice of the vocabulary (the executor takes this path when every record is plain
        and none has min_tokens pending). The uniforms are drawn here, as the gathered path draws them, so
        either path gives a row the same token."""
        random_rows = [i for i, record in enumerate(records) if not record.params.is_greedy]
        uniform = self._uniforms([records[i] for i in random_rows]) if random_rows else torch.empty(0)
        temperatures, uniforms, _ = _kernel_rows(records, random_rows, uniform)
        masked_rows = [i for i, record in enumerate(records) if record.grammar is not None and record.grammar.active]
        token_masks = b""
        if masked_rows:
            from tpengine.structured.matcher import fill_bitmask
            token_masks = fill_bitmask(len(masked_rows), vocab_size, list(range(len(masked_rows))),
                                       [records[i].grammar for i in masked_rows]).numpy().tobytes()
        return VocabParallelSampling(temperatures, uniforms, masked_rows, token_masks)

    def __call__(self, logits: torch.Tensor, records: list[SamplingRecord]) -> SamplerOutput:
        """logits: [rows, vocab], one row per record. A row with a grammar (structured outputs) first loses
        every token its grammar does not allow next; its logprobs are of what remains."""
        device = logits.device
        params = [record.params for record in records]
        raw = logits.float()
        grammar_rows = [i for i, record in enumerate(records) if record.grammar is not None and record.grammar.active]
        bitmask = None  # the grammar rows' token masks, when the CPU kernel reads them as it samples
        if grammar_rows:
            from tpengine.structured.matcher import apply_bitmask, fill_bitmask
            bitmask = fill_bitmask(raw.size(0), raw.size(1), grammar_rows, [records[i].grammar for i in grammar_rows])
            # the kernel reads masked tokens as -inf: no pass writing them over the rows; logprobs, a top-k,
            # top-p or min-p filter (the torch draw) and other devices need them written
            if not (device.type == "cpu" and cpu_sampling.available()
                    and all(params[i].logprobs is None and not params[i].has_filter for i in grammar_rows)):
                apply_bitmask(raw, bitmask, grammar_rows)
                bitmask = None
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        # float32 log-softmax of the raw logits (vLLM's default), only for rows that asked
        raw_logprobs = raw[_to_device(logprob_rows, torch.int64, device)].log_softmax(-1) if logprob_rows else None
        logits = self._penalized(raw, records, params)
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if bitmask is not None:  # greedy rows too: the kernel's first maximum among the allowed tokens
            uniform = self._uniforms([records[i] for i in random_rows]) if random_rows else torch.empty(0)
            token_ids = self._sample_on_cpu(logits, records, random_rows, uniform, bitmask)
        elif not random_rows:
            token_ids = _greedy(logits)
        else:
            token_ids = self._sample(logits, records, random_rows)
        logprobs: list[dict[int, float] | None] = [None] * len(records)
        if logprob_rows:
            self._gather_logprobs(raw_logprobs, logprob_rows, params, token_ids, logprobs)
        return SamplerOutput(token_ids, logprobs)

    def _sample(self, logits: torch.Tensor, records, random_rows: list[int]) -> list[int]:
        """Greedy rows by argmax, the random rows drawn; -1 where a row has no finite distribution."""
        uniform = self._uniforms([records[i] for i in random_rows])
        if logits.device.type == "cpu" and cpu_sampling.available():
            return self._sample_on_cpu(logits, records, random_rows, uniform)
        if len(random_rows) == len(records):  # no greedy row: no max over the vocabulary, no copy of the rows
            picked, picked_valid = self._draw(logits, records, uniform)
            return torch.where(picked_valid, picked, -1).tolist()  # the step's one wait on the device
        values, token_ids = logits.max(dim=-1)  # the first of equal maxima, as argmax
        # NaN anywhere in a row makes the max NaN; an all -inf row's is -inf: neither is a token
        valid = values.isfinite()
        rows = _to_device(random_rows, torch.int64, logits.device)
        picked, picked_valid = self._draw(logits[rows], [records[i] for i in random_rows], uniform)
        token_ids.index_copy_(0, rows, picked)
        valid.index_copy_(0, rows, picked_valid)
        return torch.where(valid, token_ids, -1).tolist()  # the step's one wait on the device

    def _sample_on_cpu(self, logits: torch.Tensor, records, random_rows: list[int], uniform: torch.Tensor,
                       bitmask: torch.Tensor | None = None) -> list[int]:
        """The CPU kernel takes every row a temperature alone shapes (greedy ones included), reading the token
        masks of grammar rows from bitmask; rows with a top-k, top-p or min-p filter are drawn by the torch
        path, with the same uniforms (none of them has a mask left to read)."""
        temperatures, uniforms, filtered = _kernel_rows(records, random_rows, uniform)
        token_ids = cpu_sampling.sample_rows(logits if logits.stride(1) == 1 else logits.contiguous(),
                                             torch.tensor(temperatures, dtype=torch.float32),
                                             torch.tensor(uniforms, dtype=torch.float64), self.num_vocab_slices,
                                             bitmask)
        if filtered:
            rows = torch.tensor([random_rows[j] for j in filtered])
            picked, valid = self._draw(logits[rows], [records[i] for i in rows.tolist()], uniform[filtered])
            token_ids[rows] = torch.where(valid, picked, -1)
        return token_ids.tolist()

    def _uniforms(self, records) -> torch.Tensor:
        """One float64 draw in [0, 1) per row, on the host: a seeded row's from its (seed, position), the
        others from the engine's generator. A verify row samples as it would if its drafts were accepted
        and it were a decode row: same draw, same token, so a seeded request's tokens do not depend on
        speculation."""
        uniform = torch.rand(len(records), dtype=torch.float64, generator=self.generator)
        for row, record in enumerate(records):
            if record.params.seed is not None:
                uniform[row] = seeded_uniform(record.params.seed, len(record.token_ids) + record.offset)
        return uniform

    def warm_up(self, logits: torch.Tensor) -> SamplerOutput:
        """Sample every row of logits with every option on: the most memory one step's sampling takes
        (the engine reserves it beside the KV cache), and the compiled filters built before any request.
        The engine's generator is left as it was, so warming up never changes a seeded run's tokens."""
        params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.01, seed=0, max_tokens=2, min_tokens=1,
                                stop_token_ids=(0,), logprobs=MAX_LOGPROBS, repetition_penalty=1.1,
                                frequency_penalty=0.1, presence_penalty=0.1, logit_bias={0: 1.0})
        state = self.generator.get_state()
        try:
            return self(logits, [SamplingRecord(params, frozenset({0}), [0, 1], 2) for _ in range(logits.size(0))])
        finally:
            self.generator.set_state(state)

    @staticmethod
    def _gather_logprobs(raw_logprobs, rows, params, token_ids, out) -> None:
        device = raw_logprobs.device
        sampled = _to_device([max(token_ids[i], 0) for i in rows], torch.int64, device)
        sampled_lp = raw_logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1).tolist()
        k = max(params[i].logprobs for i in rows)
        top_lp, top_ids = raw_logprobs.topk(k, dim=-1) if k else (None, None)
        top_lp = top_lp.tolist() if k else None
        top_ids = top_ids.tolist() if k else None
        for j, i in enumerate(rows):
            if token_ids[i] < 0:
                continue
            n = params[i].logprobs
            entry = dict(zip(top_ids[j][:n], top_lp[j][:n])) if n else {}
            entry[token_ids[i]] = sampled_lp[j]
            out[i] = entry

    @staticmethod
    def _penalized(logits: torch.Tensor, records, params) -> torch.Tensor:
        """logit_bias (vLLM applies it first), then repetition (prompt + generated, transformers'
        definition), frequency and presence (generated) penalties, then min_tokens: a completion shorter
        than it cannot sample its stop tokens."""
        bias_rows = [i for i, p in enumerate(params) if p.logit_bias is not None]
        penalty_rows = [i for i, p in enumerate(params) if p.has_penalties]
        short_rows = [i for i, record in enumerate(records) if record.min_tokens_pending]
        if not penalty_rows and not short_rows and not bias_rows:
            return logits
        device, vocab = logits.device, logits.size(1)
        logits = logits.clone()
        if bias_rows:  # the engine checked every id against the vocabulary
            rows = [i for i in bias_rows for _ in params[i].logit_bias]
            columns = [t for i in bias_rows for t in params[i].logit_bias]
            biases = [b for i in bias_rows for b in params[i].logit_bias.values()]
            logits.index_put_((_to_device(rows, torch.int64, device), _to_device(columns, torch.int64, device)),
                              _to_device(biases, torch.float32, device), accumulate=True)
        if penalty_rows:
            rows = _to_device(penalty_rows, torch.int64, device)
            # padded with an extra column `vocab` that is dropped: one scatter for every row
            padded = _padded([records[i].token_ids for i in penalty_rows], vocab, device)
            generated = _padded([records[i].token_ids[records[i].num_prompt_tokens:] for i in penalty_rows], vocab,
                                device)
            counts = torch.zeros(len(penalty_rows), vocab + 1, device=device).scatter_add_(
                1, generated, torch.ones_like(generated, dtype=torch.float32))[:, :vocab]
            seen = torch.zeros(len(penalty_rows), vocab + 1, dtype=torch.bool, device=device).scatter_(
                1, padded, True)[:, :vocab]
            rep = _to_device([params[i].repetition_penalty for i in penalty_rows], torch.float32, device).unsqueeze(1)
            freq = _to_device([params[i].frequency_penalty for i in penalty_rows], torch.float32, device).unsqueeze(1)
            pres = _to_device([params[i].presence_penalty for i in penalty_rows], torch.float32, device).unsqueeze(1)
            rows_logits = logits[rows]
            rows_logits = torch.where(seen, torch.where(rows_logits < 0, rows_logits * rep, rows_logits / rep),
                                      rows_logits)
            rows_logits = rows_logits - freq * counts - pres * (counts > 0)
            logits[rows] = rows_logits
        if short_rows:
            pairs = [(i, t) for i in short_rows for t in records[i].stop_token_ids if t < vocab]
            if pairs:
                logits[_to_device([r for r, _ in pairs], torch.int64, device),
                       _to_device([t for _, t in pairs], torch.int64, device)] = float("-inf")
        return logits

    def _draw(self, logits: torch.Tensor, records, uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row from its filtered distribution, by inverse CDF: the row's uniform draw (host
        float64) picks the token whose slice of the cumulative distribution holds it. float64 keeps the
        slices of unlikely tokens exact over a large vocabulary. (An exponential race needs a draw per
        vocabulary entry: 13x the time on the CPU, docs/benchmarks.md.) Also returns which rows had a
        distribution at all."""
        device = logits.device
        params = [record.params for record in records]
        cdf = self._filtered_probs(logits, params).cumsum(dim=-1, dtype=torch.float64)
        if device.type != "cpu":
            uniform = uniform.pin_memory().to(device, non_blocking=True)
        total = cdf[:, -1:]
        # right side: the first token whose cumulative mass exceeds the draw, so a token filtered
        # to probability 0 (an empty slice) is never picked
        picked = torch.searchsorted(cdf, uniform.unsqueeze(1) * total, right=True).clamp_(max=cdf.size(1) - 1)
        valid = (total.squeeze(1) > 0) & total.squeeze(1).isfinite()
        return picked.squeeze(1), valid

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, params) -> torch.Tensor:
        # Which limits any row sets is decided here, in Python: no tensor work for an unused filter,
        # and no data-dependent branch inside the compiled math.
        device = logits.device
        temperatures = _to_device([p.temperature for p in params], torch.float32, device)
        top_ks = top_ps = min_ps = None
        if any(p.top_k != -1 for p in params):
            vocab = logits.size(1)
            top_ks = _to_device([vocab if p.top_k == -1 else min(p.top_k, vocab) for p in params], torch.int64, device)
        if any(p.top_p < 1.0 for p in params):
            top_ps = _to_device([p.top_p for p in params], torch.float32, device)
        if any(p.min_p > 0.0 for p in params):
            min_ps = _to_device([p.min_p for p in params], torch.float32, device)
        return filtered_probs(logits, temperatures, top_ks, top_ps, min_ps)


def sample_vocab_parallel(logits: torch.Tensor, rows: VocabParallelSampling, group,
                          vocab_start: int) -> list[int] | None:
    """Every rank's part of sampling a step over its own slice of the vocabulary (logits: this rank's
    columns, vocab_start onwards): each rank sums its slice per row, the ranks share those few numbers
    (one all-reduce), the rank whose slice holds a row's draw finds the token, and a second all-reduce
    brings the tokens together. The CPU kernel's tokens, as rank 0 would sample the gathered logits (with
    the masked rows' token masks read as its sampler reads them): token ids on rank 0, None on the others.
    Collective."""
    logits = logits.float()
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    temperatures = torch.tensor(rows.temperatures, dtype=torch.float32)
    uniforms = torch.tensor(rows.uniforms, dtype=torch.float64)
    bitmask = None
    if rows.masked_rows:
        masks = torch.frombuffer(bytearray(rows.token_masks), dtype=torch.int32).view(len(rows.masked_rows), -1)
        bitmask = torch.full((logits.size(0), masks.size(1)), -1, dtype=torch.int32)  # -1: every token allowed
        bitmask[torch.tensor(rows.masked_rows)] = masks
    stats, sums = cpu_sampling.slice_stats(logits, temperatures, bitmask, vocab_start)
    all_stats = torch.zeros(group.size, *stats.shape, dtype=torch.float64)
    all_stats[group.rank] = stats
    group.all_reduce(all_stats)  # x + 0 is x: every rank gets every rank's stats, bit for bit
    tokens = torch.zeros(logits.size(0), dtype=torch.float64)
    cpu_sampling.slice_tokens(logits, temperatures, uniforms, all_stats, sums, group.rank, vocab_start, tokens,
                              bitmask)
    group.all_reduce(tokens)  # each row's token comes from one rank; the others add 0
    return tokens.long().tolist() if group.rank == 0 else None


def greedy_on_every_rank(logits: torch.Tensor, group, vocab_start: int) -> list[int]:
    """Each row's argmax over the whole vocabulary, on every rank, from each rank's own slice of the logits
    (columns vocab_start onwards): one all-reduce of every rank's maxima and their tokens, then the first
    rank with the largest, so the lowest token id among equal maxima, as argmax. Collective when tp > 1."""
    values, token_ids = logits.max(dim=-1)
    if group.size == 1:
        return token_ids.tolist()
    # float64 holds a float32 maximum and a token id exactly; x + 0 is x, so every rank gets every rank's
    shared = torch.zeros(2, group.size, logits.size(0), dtype=torch.float64, device=logits.device)
    shared[0, group.rank] = values
    shared[1, group.rank] = token_ids + vocab_start
    group.all_reduce(shared)
    best = shared[0].argmax(dim=0, keepdim=True)
    return shared[1].gather(0, best)[0].long().tolist()


def _kernel_rows(records, random_rows: list[int], uniform: torch.Tensor) -> tuple[list[float], list[float], list[int]]:
    """What the CPU kernel takes per row, temperature and uniform (0 and 0.0 for a greedy row), and the
    positions in random_rows of the rows with a top-k, top-p or min-p filter, which the kernel takes as
    greedy and the torch path draws instead."""
    temperatures, uniforms, filtered = [0.0] * len(records), [0.0] * len(records), []
    for j, (i, drawn) in enumerate(zip(random_rows, uniform.tolist())):
        if records[i].params.has_filter:
            filtered.append(j)
        else:
            temperatures[i], uniforms[i] = records[i].params.temperature, drawn
    return temperatures, uniforms, filtered


def _greedy(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (the first of equal maxima, as argmax), -1 where the maximum is not finite (NaN
    anywhere in the row, or every logit -inf). One max over the rows: the greedy step's whole sampling."""
    values, token_ids = logits.max(dim=-1)
    if logits.device.type != "cpu":  # one wait on the device
        return torch.where(values.isfinite(), token_ids, -1).tolist()
    return [token if math.isfinite(value) else -1 for token, value in zip(token_ids.tolist(), values.tolist())]


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
        # the kept values scattered back through the permutation (Inductor fails on a scatter of bools)
        probs = probs.scatter(1, order, sorted_probs.masked_fill(drop_sorted, 0.0))
    if min_ps is not None:
        threshold = min_ps.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs
