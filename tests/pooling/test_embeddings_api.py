"""POST /v1/embeddings in `tpengine serve` through the openai client: the vectors equal the offline LLM.embed's
(within 1e-6) and sentence-transformers' (cosine), as floats and as base64, for text and token inputs and batches;
usage counts the tokens; bad requests are 400s naming the field. One server, on a tiny last-token Matryoshka
checkpoint, with the pooling runner."""
import base64

import numpy as np
import openai
import pytest

from tests.entrypoints.conftest import running_server
from tests.entrypoints.test_errors import assert_openai_error
from tests.pooling.models import cosine, st_embed, st_embed_token_ids, write_tiny_embedding_model
from tpengine import LLM, PoolingParams

MAX_MODEL_LEN = 512  # running_server's
TEXTS = ["hi", "Hello, my name is", "The quick brown fox jumps over the lazy dog."]
TOKEN_PROMPTS = [[5, 6, 7], [40 + j for j in range(30)]]
DIMENSIONS = [32, 16]
MIN_COSINE = 0.99999


@pytest.fixture(scope="module")
def embedding_model(tmp_path_factory) -> str:
    return write_tiny_embedding_model(str(tmp_path_factory.mktemp("embedding_server") / "model"), seed=4,
                                      matryoshka_dimensions=DIMENSIONS, bare_weights=True)


@pytest.fixture(scope="module")
def offline(embedding_model):
    """The offline engine's embeddings, by what was embedded."""
    with LLM(embedding_model, runner="pooling", dtype="float32", kvcache_block_size=16,
             max_model_len=MAX_MODEL_LEN) as llm:
        def vectors(prompts, params=None):
            return np.array([out.outputs.embedding for out in llm.embed(prompts, params, use_tqdm=False)])
        long_ids = llm.get_tokenizer().encode("z" * 600)
        yield {"texts": vectors(TEXTS), "tokens": vectors(TOKEN_PROMPTS),
               "dimensions": vectors(TEXTS, PoolingParams(dimensions=16)),
               "truncated": vectors(["z" * 600], PoolingParams(truncate_prompt_tokens=10)),
               "token_counts": [len(llm.get_tokenizer().encode(text)) for text in TEXTS], "long_ids": long_ids}


@pytest.fixture(scope="module")
def server(embedding_model):
    yield from running_server(embedding_model, "--dtype", "float32", "--runner", "pooling", "--no-warm-up")


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60.0) as client:
        yield client


def vectors_of(response) -> np.ndarray:
    assert [item.index for item in response.data] == list(range(len(response.data)))
    assert all(item.object == "embedding" for item in response.data)
    return np.array([item.embedding for item in response.data])


def test_a_batch_of_texts_as_floats_equals_offline_and_sentence_transformers(client, offline, embedding_model):
    response = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    assert response.object == "list" and response.model == "tiny"
    ours = vectors_of(response)
    np.testing.assert_allclose(ours, offline["texts"], atol=1e-6)
    assert cosine(ours, st_embed(embedding_model, TEXTS)).min() >= MIN_COSINE
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(offline["token_counts"])


def test_base64_is_little_endian_float32_and_the_client_decodes_it(client, server, offline):
    # no encoding_format: the client asks for base64 and decodes it itself
    np.testing.assert_allclose(vectors_of(client.embeddings.create(model="tiny", input=TEXTS)), offline["texts"],
                               atol=1e-6)
    status, body = server.request("POST", "/v1/embeddings", {"input": TEXTS, "encoding_format": "base64"})
    assert status == 200, body
    decoded = [np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4") for item in body["data"]]
    np.testing.assert_allclose(np.array(decoded), offline["texts"], atol=1e-6)


def test_one_string_and_token_id_inputs(client, offline, embedding_model):
    one = client.embeddings.create(model="tiny", input=TEXTS[1], encoding_format="float")
    np.testing.assert_allclose(vectors_of(one), offline["texts"][1:2], atol=1e-6)
    assert one.usage.prompt_tokens == offline["token_counts"][1]
    batch = client.embeddings.create(model="tiny", input=TOKEN_PROMPTS, encoding_format="float")
    np.testing.assert_allclose(vectors_of(batch), offline["tokens"], atol=1e-6)
    assert cosine(vectors_of(batch), st_embed_token_ids(embedding_model, TOKEN_PROMPTS)).min() >= MIN_COSINE
    assert batch.usage.prompt_tokens == sum(map(len, TOKEN_PROMPTS))
    single = client.embeddings.create(model="tiny", input=TOKEN_PROMPTS[1], encoding_format="float", user="someone")
    np.testing.assert_allclose(vectors_of(single), offline["tokens"][1:], atol=1e-6)


def test_dimensions_shorten_a_matryoshka_models_vectors(client, offline):
    response = client.embeddings.create(model="tiny", input=TEXTS, dimensions=16, encoding_format="float")
    ours = vectors_of(response)
    assert ours.shape == (len(TEXTS), 16)
    np.testing.assert_allclose(ours, offline["dimensions"], atol=1e-6)


def test_truncate_prompt_tokens_embeds_the_last_tokens_of_a_long_input(client, offline):
    response = client.embeddings.create(model="tiny", input="z" * 600, encoding_format="float",
                                        extra_body={"truncate_prompt_tokens": 10})
    np.testing.assert_allclose(vectors_of(response), offline["truncated"], atol=1e-6)
    assert response.usage.prompt_tokens == 10
    tokens = client.embeddings.create(model="tiny", input=offline["long_ids"], encoding_format="float",
                                      extra_body={"truncate_prompt_tokens": 10})
    np.testing.assert_allclose(vectors_of(tokens), offline["truncated"], atol=1e-6)


@pytest.mark.parametrize("body, param, message", [
    ({"input": "z" * 600}, "input", "max_model_len"),
    ({"input": [list(range(5))] + [[7] * 600]}, "input", "max_model_len"),
    ({"input": TEXTS, "dimensions": 24}, "dimensions", "matryoshka_dimensions"),
    ({"input": TEXTS, "dimensions": 0}, "dimensions", "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format", "encoding_format"),
    ({"input": ""}, "input", "empty"),
    ({"input": []}, "input", "empty"),
    ({"input": [1.5]}, "input", "input"),
    ({"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "truncate_prompt_tokens"),
    ({"input": "hi", "normalise": True}, "normalise", "unknown field"),
], ids=["too-long-text", "too-long-tokens", "unlisted-dimensions", "zero-dimensions", "bad-encoding", "empty",
        "empty-list", "float-token", "zero-truncation", "unknown-field"])
def test_bad_requests_are_400s_naming_the_field(server, body, param, message):
    status, answer = server.request("POST", "/v1/embeddings", body)
    assert status == 400, answer
    assert_openai_error(status, answer, message)
    assert answer["error"]["param"] == param


def test_the_openai_client_raises_bad_request_and_an_unknown_model_is_404(client):
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.embeddings.create(model="tiny", input="z" * 600)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="hi")


def test_a_pooling_server_refuses_completions(client):
    with pytest.raises(openai.BadRequestError, match="pooling"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=2)


def test_metrics_count_an_embeddings_prompt_tokens_and_its_success(client, server, offline):
    prompt_tokens = server.metric("tpengine:prompt_tokens_total")
    successes = server.metric("tpengine:request_success_total", finished_reason="stop")
    client.embeddings.create(model="tiny", input=TEXTS)
    assert server.metric("tpengine:prompt_tokens_total") == prompt_tokens + sum(offline["token_counts"])
    assert server.metric("tpengine:request_success_total", finished_reason="stop") == successes + len(TEXTS)
