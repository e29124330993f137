"""SamplingParams: documented defaults, and invalid values rejected with ValueError when made."""
import pytest

from tpengine.sampling_params import SamplingParams


def test_defaults():
    assert SamplingParams() == SamplingParams(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, max_tokens=64,
                                              ignore_eos=False, stop_token_ids=(), seed=None)
    params = SamplingParams()
    assert (params.temperature, params.top_k, params.top_p, params.min_p) == (1.0, -1, 1.0, 0.0)
    assert (params.max_tokens, params.ignore_eos, params.stop_token_ids, params.seed) == (64, False, (), None)


@pytest.mark.parametrize("temperature", [-0.1, -1.0, float("nan")])
def test_a_negative_temperature_raises(temperature):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=temperature)


@pytest.mark.parametrize("top_k", [0, -2, -10])
def test_top_k_zero_or_below_minus_one_raises(top_k):
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=top_k)


@pytest.mark.parametrize("top_p", [0.0, -0.5, 1.01, float("nan")])
def test_top_p_outside_zero_exclusive_to_one_raises(top_p):
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=top_p)


@pytest.mark.parametrize("min_p", [-0.01, 1.01, float("nan")])
def test_min_p_outside_zero_to_one_raises(min_p):
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=min_p)


@pytest.mark.parametrize("max_tokens", [0, -1, 1.5, 10.0, "8", None, True])
def test_max_tokens_that_is_not_a_positive_integer_raises(max_tokens):
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=max_tokens)


@pytest.mark.parametrize("params", [
    dict(temperature=0.0), dict(top_k=-1), dict(top_k=1), dict(top_p=1.0), dict(top_p=1e-6),
    dict(min_p=0.0), dict(min_p=1.0), dict(max_tokens=1),
])
def test_values_at_the_edges_of_their_ranges_are_accepted(params):
    SamplingParams(**params)


def test_stop_token_ids_are_stored_as_a_tuple():
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


def test_temperature_zero_is_greedy():
    assert SamplingParams(temperature=0.0).is_greedy and not SamplingParams().is_greedy
