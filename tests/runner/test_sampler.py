"""The sampler: greedy is argmax, filters narrow the choice, seeded requests ignore their batch mates."""
import pytest
import torch

from tpengine import SamplingParams
from tpengine.sampling_params import SamplingRecord
from tpengine.kernels.cpu import sampling as cpu_sampling
from tpengine.runner.sampler import Sampler

_sampler = Sampler(seed=None)


@pytest.fixture(autouse=True, params=["cpu kernel", "torch"])
def sampling_path(request, monkeypatch):
    """Every test runs on the CPU kernel (rows a temperature alone shapes) and on the torch path."""
    if request.param == "torch":
        monkeypatch.setattr(cpu_sampling, "available", lambda: False)
    elif not cpu_sampling.available():
        pytest.skip("the CPU sampling kernel does not build here")


def record(token_ids: list[int], params: SamplingParams, stop_token_ids=()) -> SamplingRecord:
    """A sampled row's record, its whole token list a prompt."""
    return SamplingRecord(params, frozenset(stop_token_ids), token_ids, len(token_ids))


def sampler(logits, params, positions):
    """Token ids for rows with these params, each row keyed by its position."""
    return _sampler(logits, [record([1] * (n + 1), p) for p, n in zip(params, positions)]).token_ids


def random_logits(batch, vocab=50, seed=0):
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_temperature_zero_is_argmax():
    logits = random_logits(4)
    assert sampler(logits, [SamplingParams(temperature=0)] * 4, [1] * 4) == logits.argmax(-1).tolist()


def test_top_k_1_top_p_tiny_and_min_p_1_all_reduce_to_argmax():
    logits = random_logits(3, seed=1)
    params = [SamplingParams(temperature=1.5, top_k=1), SamplingParams(temperature=1.5, top_p=1e-6),
              SamplingParams(temperature=1.5, min_p=1.0)]
    for _ in range(5):
        assert sampler(logits, params, [1, 2, 3]) == logits.argmax(-1).tolist()


def test_top_k_never_samples_outside_the_k_likeliest():
    logits = random_logits(1, seed=2)
    top5 = set(logits[0].topk(5).indices.tolist())
    params = [SamplingParams(temperature=5.0, top_k=5)]
    assert all(sampler(logits, params, [i])[0] in top5 for i in range(200))


def test_top_p_keeps_the_smallest_set_covering_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    params = [SamplingParams(temperature=1.0, top_p=0.7)]
    seen = {sampler(probs.log(), params, [i])[0] for i in range(300)}
    assert seen == {0, 1}


def test_samples_follow_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    torch.manual_seed(0)
    draws = [sampler(probs.log().unsqueeze(0), [SamplingParams(temperature=1.0)], [1])[0] for _ in range(3000)]
    freq = torch.bincount(torch.tensor(draws), minlength=3).float() / len(draws)
    assert torch.allclose(freq, probs, atol=0.04)


def test_seeded_request_gets_the_same_tokens_whatever_its_batch():
    logits = random_logits(3, seed=3)
    seeded = SamplingParams(temperature=1.0, seed=42)
    alone = [sampler(logits[1:2], [seeded], [n])[0] for n in range(10, 20)]
    other = SamplingParams(temperature=1.0)
    in_batch = [sampler(logits, [other, seeded, SamplingParams(temperature=0)], [5, n, 7])[1] for n in range(10, 20)]
    assert alone == in_batch
    assert len(set(alone)) > 1  # the seed keys the noise by position: not one fixed token


def test_a_seed_fixes_the_draws_and_another_seed_changes_them():
    logits = random_logits(1, vocab=1000, seed=4) * 0.01

    def draws(seed):
        torch.manual_seed(seed + 100)  # the global generator must not matter to a seeded request
        return [sampler(logits, [SamplingParams(temperature=1.0, seed=seed)], [n])[0] for n in range(20)]

    first = draws(1)
    assert draws(1) == first
    assert draws(2) != first


def test_mixed_batch_keeps_greedy_rows_greedy_and_each_sampled_row_on_its_own_distribution():
    first, second = torch.tensor([0.05, 0.7, 0.25]), torch.tensor([0.2, 0.2, 0.6])
    logits = torch.stack([second.log(), first.log(), second.log()])
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams(temperature=1.0)]
    torch.manual_seed(1)
    draws = torch.tensor([sampler(logits, params, [1, 1, 1]) for _ in range(3000)])
    assert (draws[:, 0] == 2).all()
    for column, probs in ((1, first), (2, second)):
        freq = torch.bincount(draws[:, column], minlength=3).float() / len(draws)
        assert torch.allclose(freq, probs, atol=0.04)


def test_warm_up_samples_every_row_with_every_option_and_keeps_the_engine_generator():
    engine_sampler = Sampler(seed=7)
    state = engine_sampler.generator.get_state()
    out = engine_sampler.warm_up(random_logits(6))
    assert len(out.token_ids) == 6 and all(0 <= t < 50 for t in out.token_ids)
    assert all(len(entry) >= 20 for entry in out.logprobs)  # logprobs were computed for every row
    assert torch.equal(engine_sampler.generator.get_state(), state)


def test_rows_without_a_finite_distribution_get_no_token_and_leave_the_others_alone():
    logits = random_logits(4, seed=5)
    logits[1] = float("nan")
    logits[2] = float("-inf")
    logits[3, 7] = float("nan")  # one NaN poisons the row: argmax would pick it
    for temperature in (0.0, 1.0):
        params = [SamplingParams(temperature=temperature, seed=1)] * 4
        tokens = sampler(logits, params, [3] * 4)
        assert tokens[1:] == [-1, -1, -1] and 0 <= tokens[0] < logits.size(1)


def test_seeded_draws_are_a_pure_function_of_seed_and_position():
    from tpengine.runner.sampler import seeded_uniform
    draws = [seeded_uniform(seed, position) for seed in range(3) for position in range(200)]
    assert draws == [seeded_uniform(seed, position) for seed in range(3) for position in range(200)]
    assert all(0.0 <= u < 1.0 for u in draws) and len(set(draws)) == len(draws)
    assert abs(sum(draws) / len(draws) - 0.5) < 0.05


def test_logprobs_only_for_rows_that_asked_with_the_sampled_token_included():
    logits = random_logits(2, seed=6)
    out = _sampler(logits, [record([1, 2], SamplingParams(temperature=0.0, logprobs=2)), record([1, 2], SamplingParams())])
    reference = logits[0].float().log_softmax(-1)
    assert out.logprobs[1] is None
    top = reference.topk(2)
    assert out.logprobs[0] == pytest.approx(dict(zip(top.indices.tolist(), top.values.tolist())), abs=1e-6)
    assert out.token_ids[0] == top.indices[0].item()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: host-device synchronization is a CUDA matter")
def test_a_cuda_step_waits_on_the_device_only_for_its_tokens():
    import warnings
    logits = random_logits(6, vocab=1000, seed=7).cuda()
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=3),
              SamplingParams(temperature=1.0, top_k=20, top_p=0.9, min_p=0.05),
              SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2),
              SamplingParams(temperature=0.7, min_tokens=4, stop_token_ids=[5]), SamplingParams(temperature=1.2)]
    seqs = [record([1, 2, 3, 4, 5], p, [0, *p.stop_token_ids]) for p in params]
    _sampler(logits, seqs)  # compiles the filters first
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            tokens = _sampler(logits, seqs).token_ids
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    assert len(syncs) == 1, [str(w.message) for w in syncs]  # the final copy of the token ids
    assert all(0 <= t < 1000 for t in tokens) and tokens[4] not in (0, 5)
