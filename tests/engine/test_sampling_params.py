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


@pytest.mark.parametrize("kwargs, message", [
    (dict(top_k=2.5), "top_k must be an integer"), (dict(top_k=True), "top_k must be an integer"),
    (dict(n=True), "n must be an integer"), (dict(n=0), "n must be >= 1"), (dict(seed=1.5), "seed must be an integer"),
    (dict(seed=True), "seed must be an integer"), (dict(temperature="1"), "temperature must be a number"),
    (dict(temperature=True), "temperature must be a number"), (dict(temperature=1e-45), "temperature must be 0"),
    (dict(temperature=float("inf")), "temperature must be 0"), (dict(top_p=1e-300), "nonzero in float32"),
    (dict(min_tokens=9, max_tokens=8), "min_tokens must be in"), (dict(logprobs=21), "logprobs must be None or in"),
    (dict(logprobs=True), "logprobs must be an integer"), (dict(stop=""), "stop strings must not be empty"),
    (dict(stop=["a", 3]), "stop must be a string or a list of strings"), (dict(stop_token_ids=[True]), "stop_token_ids"),
    (dict(stop_token_ids="ab"), "stop_token_ids must be a list"), (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(ignore_eos=1), "ignore_eos must be True or False"), (dict(skip_special_tokens=None), "skip_special_tokens"),
])
def test_wrong_types_and_values_that_cannot_be_sampled_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_values_are_normalized_to_their_types():
    import numpy as np
    params = SamplingParams(temperature=1, top_k=np.int64(5), stop="\n", stop_token_ids=[np.int32(3)], min_tokens=2)
    assert isinstance(params.temperature, float) and type(params.top_k) is int and params.top_k == 5
    assert params.stop == ("\n",) and params.stop_token_ids == (3,) and type(params.stop_token_ids[0]) is int
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b") and SamplingParams().stop == ()
