"""LLM.embed against sentence-transformers' encode (the oracle): last-token, mean and CLS pooling at tp 1 and 2,
prompts of different lengths in one call through chunked prefill, Matryoshka dimensions, truncate_prompt_tokens,
the ValueErrors, and embeddings sharing an engine's steps with generation."""
import numpy as np
import pytest

from tests.pooling.models import (cosine, load_st_model, st_embed, st_embed_token_ids, st_token_ids,
                                  write_tiny_embedding_model)
from tpengine import LLM, PoolingParams, SamplingParams

MIN_COSINE = 0.99999
MAX_MODEL_LEN = 128
# 16-token chunks and blocks: the longer texts (and EOS) prefill over several steps, several prompts a step
CHUNKED = dict(kvcache_block_size=16, max_num_batched_tokens=16, max_model_len=MAX_MODEL_LEN, dtype="float32")
TEXTS = ["hi", "Hello, my name is", "The quick brown fox jumps over the lazy dog.",
         "Retrieval pipelines embed and rerank; evaluation harnesses score prompts, one context at a time."]
MATRYOSHKA_DIMENSIONS = [32, 16]
# the checkpoints by the pooling their sentence-transformers files name; "lasttoken" is laid out as
# Qwen3-Embedding is (weights without the "model." prefix, no LM head), "mean" is a Matryoshka model and "cls"
# leaves its vectors unnormalized (no Normalize module)
CHECKPOINTS = {"lasttoken": dict(pooling="lasttoken", seed=1, bare_weights=True),
               "mean": dict(pooling="mean", seed=2, matryoshka_dimensions=MATRYOSHKA_DIMENSIONS),
               "cls": dict(pooling="cls", seed=3, normalize=False)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("embedding_models")
    return {name: write_tiny_embedding_model(str(root / name), **settings) for name, settings in CHECKPOINTS.items()}


@pytest.fixture(scope="module")
def st_models(checkpoints):
    return {name: load_st_model(path) for name, path in checkpoints.items()}


@pytest.fixture(scope="module")
def engines(checkpoints):
    """Engines made on first use, by (checkpoint, tensor_parallel_size), shut down with the module."""
    made: dict[tuple[str, int], LLM] = {}

    def engine(name: str, tp: int = 1) -> LLM:
        if (name, tp) not in made:
            made[name, tp] = LLM(checkpoints[name], runner="pooling", tensor_parallel_size=tp, **CHUNKED)
        return made[name, tp]

    yield engine
    for llm in made.values():
        llm.shutdown()


def embeddings(outputs) -> np.ndarray:
    return np.array([output.outputs.embedding for output in outputs], dtype=np.float32)


def assert_close_to(ours: np.ndarray, expected: np.ndarray) -> None:
    """Same direction (cosine) and, for unnormalized vectors too, the same length."""
    assert ours.shape == expected.shape
    assert cosine(ours, expected).min() >= MIN_COSINE, cosine(ours, expected)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=-1), np.linalg.norm(expected, axis=-1), rtol=1e-4)


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_embeddings_of_prompts_of_different_lengths_equal_sentence_transformers(engines, st_models, name, tp):
    llm = engines(name, tp)
    outputs = llm.embed(TEXTS, use_tqdm=False)
    assert [output.finished for output in outputs] == [True] * len(TEXTS)
    tokenizer = llm.get_tokenizer()
    assert [output.prompt_token_ids for output in outputs] == [tokenizer.encode(text) for text in TEXTS]
    assert_close_to(embeddings(outputs), st_embed(st_models[name], TEXTS))


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_sentence_transformers_feeds_its_model_the_token_ids_the_engine_runs(engines, st_models, name):
    tokenizer = engines(name).get_tokenizer()
    assert [st_token_ids(st_models[name], text) for text in TEXTS] == [tokenizer.encode(text) for text in TEXTS]


def test_last_token_pooling_pools_the_eos_the_tokenizer_appends(engines):
    """Qwen3-Embedding's tokenizer ends every text with <|endoftext|>; the pooled row is that token's."""
    outputs = engines("lasttoken").embed(TEXTS[:2], use_tqdm=False)
    assert all(output.prompt_token_ids[-1] == 256 for output in outputs)


def test_token_id_prompts_and_a_second_call_give_the_same_embeddings(engines, st_models):
    """Token ids embed as sentence-transformers' modules do on those ids; the second call's prompts hit the
    prefix cache (last-token) or recompute (mean), and give the same vectors."""
    prompts = [[5 + 3 * j % 250 for j in range(n)] for n in (1, 17, 32, 40)]  # 32: whole blocks, all cached
    for name in ("lasttoken", "mean"):
        llm = engines(name)
        first = embeddings(llm.embed(prompts, use_tqdm=False))
        assert_close_to(first, st_embed_token_ids(st_models[name], prompts))
        np.testing.assert_allclose(embeddings(llm.embed(prompts, use_tqdm=False)), first, atol=1e-6)


def test_pooling_params_normalize_overrides_the_checkpoint(engines, st_models):
    normalized = embeddings(engines("cls").embed(TEXTS, PoolingParams(normalize=True), use_tqdm=False))
    np.testing.assert_allclose(np.linalg.norm(normalized, axis=-1), 1.0, rtol=1e-5)
    assert cosine(normalized, st_embed(st_models["cls"], TEXTS)).min() >= MIN_COSINE
    raw = embeddings(engines("lasttoken").embed(TEXTS, PoolingParams(normalize=False), use_tqdm=False))
    assert np.abs(np.linalg.norm(raw, axis=-1) - 1.0).max() > 1e-3
    assert cosine(raw, st_embed(st_models["lasttoken"], TEXTS)).min() >= MIN_COSINE


@pytest.mark.parametrize("dimensions", MATRYOSHKA_DIMENSIONS)
def test_matryoshka_dimensions_keep_the_first_ones_then_normalize(engines, st_models, dimensions):
    ours = embeddings(engines("mean").embed(TEXTS, PoolingParams(dimensions=dimensions), use_tqdm=False))
    truncated = st_embed(st_models["mean"], TEXTS, truncate_dim=dimensions)
    expected = truncated / np.linalg.norm(truncated, axis=-1, keepdims=True)
    assert ours.shape == (len(TEXTS), dimensions)
    assert_close_to(ours, expected)


def test_dimensions_a_model_does_not_list_or_support_are_value_errors(engines):
    with pytest.raises(ValueError, match="matryoshka_dimensions"):
        engines("mean").embed(TEXTS, PoolingParams(dimensions=24), use_tqdm=False)
    with pytest.raises(ValueError, match="Matryoshka"):
        engines("lasttoken").embed(TEXTS, PoolingParams(dimensions=16), use_tqdm=False)


def test_truncate_prompt_tokens_keeps_the_last_tokens(engines, st_models):
    llm = engines("lasttoken")
    long_text = "x" + TEXTS[3] * 2  # past MAX_MODEL_LEN
    token_ids = llm.get_tokenizer().encode(long_text)
    assert len(token_ids) > MAX_MODEL_LEN
    kept = llm.embed([long_text, long_text], [PoolingParams(truncate_prompt_tokens=20),
                                              PoolingParams(truncate_prompt_tokens=-1)], use_tqdm=False)
    assert [output.prompt_token_ids for output in kept] == [token_ids[-20:], token_ids[-MAX_MODEL_LEN:]]
    assert_close_to(embeddings(kept), st_embed_token_ids(st_models["lasttoken"], [token_ids[-20:],
                                                                                   token_ids[-MAX_MODEL_LEN:]]))
    # LLM.embed's own argument, as vLLM's
    alias = llm.embed([long_text], truncate_prompt_tokens=20, use_tqdm=False)
    np.testing.assert_allclose(embeddings(alias), embeddings(kept[:1]), atol=1e-6)


def test_a_prompt_past_max_model_len_is_a_value_error_naming_the_limit(engines):
    llm = engines("lasttoken")
    with pytest.raises(ValueError, match=str(MAX_MODEL_LEN)):
        llm.embed(["hi", "y" * MAX_MODEL_LEN], use_tqdm=False)
    with pytest.raises(ValueError, match=str(MAX_MODEL_LEN)):  # truncated, still longer than the limit
        llm.embed(["y" * 2 * MAX_MODEL_LEN], PoolingParams(truncate_prompt_tokens=MAX_MODEL_LEN + 1), use_tqdm=False)
    assert embeddings(llm.embed(["hi"], use_tqdm=False)).shape == (1, 64)  # nothing was left half-run


def test_a_pooling_engine_refuses_to_generate(engines):
    with pytest.raises(ValueError, match="pooling"):
        engines("lasttoken").generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False)


def test_task_embed_is_the_pooling_runner(checkpoints, st_models):
    with LLM(checkpoints["lasttoken"], task="embed", **CHUNKED) as llm:
        assert llm.config.runner == "pooling"
        assert_close_to(embeddings(llm.embed(TEXTS[:2], use_tqdm=False)), st_embed(st_models["lasttoken"],
                                                                                     TEXTS[:2]))


def test_embeddings_share_steps_with_generation_in_one_engine(checkpoints, st_models):
    """A generating engine embeds too: requests of both kinds queued together, stepped to the end through a cache
    small enough to preempt; the tokens are those of a generate-only run and the vectors sentence-transformers'."""
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with LLM(checkpoints["mean"], num_kvcache_blocks=12, **CHUNKED) as llm:
        alone = [output.outputs[0].token_ids for output in llm.generate(TEXTS, greedy, use_tqdm=False)]
        kinds = {}
        for i, text in enumerate(TEXTS):  # interleaved: generation, embedding, generation, ...
            kinds[llm.add_request(text, greedy, stream=False)] = ("generate", i)
            kinds[llm.add_request(text, PoolingParams(), stream=False)] = ("embed", i)
        results = {}
        while llm.has_unfinished_requests():
            for output in llm.step():
                assert output.request_id not in results, "a request reported twice"
                assert output.finished
                results[output.request_id] = output
        assert llm.num_preemptions > 0
    assert set(results) == set(kinds)
    by_kind = {kinds[request_id]: output for request_id, output in results.items()}
    assert [by_kind["generate", i].outputs[0].token_ids for i in range(len(TEXTS))] == alone
    mixed = embeddings([by_kind["embed", i] for i in range(len(TEXTS))])
    assert_close_to(mixed, st_embed(st_models["mean"], TEXTS))
