"""POST /score and /rerank (and /v1, /v2) in `tpengine serve`: the scores equal the offline LLM.score's, for a
cross-encoder checkpoint and for Qwen3-Reranker read with --hf-overrides (warmed up: a classifier's warm-up runs
prompt steps only); /rerank orders by score, keeps top_n, returns the documents' texts unless told not to; the
shapes are vLLM's; bad requests are 400s naming the field."""
import json

import pytest

from tests.entrypoints.conftest import running_server
from tests.lora.adapters import write_tiny_base
from tests.pooling.models import write_tiny_classifier
from tests.pooling.test_score import DOCUMENTS, QUERY, RERANKER
from tpengine import LLM

SETTINGS = dict(dtype="float32", kvcache_block_size=16, max_model_len=512)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory) -> str:
    return write_tiny_classifier(str(tmp_path_factory.mktemp("score_server") / "model"), num_labels=1, seed=9)


@pytest.fixture(scope="module")
def offline_scores(cross_encoder) -> list[float]:
    with LLM(cross_encoder, **SETTINGS) as llm:
        return [output.outputs.score for output in llm.score(QUERY, DOCUMENTS, use_tqdm=False)]


@pytest.fixture(scope="module")
def server(cross_encoder):
    yield from running_server(cross_encoder, "--dtype", "float32", "--warm-up")


def test_score_answers_in_vllms_shape_with_the_offline_scores(server, offline_scores):
    for body in ({"text_1": QUERY, "text_2": DOCUMENTS}, {"queries": QUERY, "documents": DOCUMENTS},
                 {"model": "tiny", "data_1": [QUERY] * len(DOCUMENTS), "data_2": DOCUMENTS}):
        status, response = server.request("POST", "/score", body)
        assert status == 200, response
        assert response["object"] == "list" and response["id"].startswith("score-")
        assert [item["index"] for item in response["data"]] == list(range(len(DOCUMENTS)))
        assert all(item["object"] == "score" for item in response["data"])
        assert [item["score"] for item in response["data"]] == pytest.approx(offline_scores, abs=1e-6)
        assert response["usage"]["prompt_tokens"] == response["usage"]["total_tokens"] > 0
    status, response = server.request("POST", "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS[0]})
    assert status == 200 and response["data"][0]["score"] == pytest.approx(offline_scores[0], abs=1e-6)


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_orders_documents_by_score_and_keeps_top_n(server, offline_scores, path):
    status, response = server.request("POST", path, {"query": QUERY, "documents": DOCUMENTS, "top_n": 2})
    assert status == 200, response
    best = sorted(range(len(DOCUMENTS)), key=lambda i: -offline_scores[i])[:2]
    assert [result["index"] for result in response["results"]] == best
    for result in response["results"]:
        assert result["relevance_score"] == pytest.approx(offline_scores[result["index"]], abs=1e-6)
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}
    assert response["usage"]["total_tokens"] > 0 and response["id"].startswith("rerank-")


def test_rerank_takes_cohere_documents_and_can_leave_their_text_out(server, offline_scores):
    documents = [{"text": document} for document in DOCUMENTS]
    status, response = server.request("POST", "/v2/rerank", {"query": QUERY, "documents": documents,
                                                             "return_documents": False})
    assert status == 200, response
    assert len(response["results"]) == len(DOCUMENTS)
    assert all("document" not in result for result in response["results"])
    assert sorted(result["relevance_score"] for result in response["results"]) == \
        pytest.approx(sorted(offline_scores), abs=1e-6)


@pytest.mark.parametrize("path, body, param", [
    ("/score", {"text_1": [QUERY, QUERY], "text_2": DOCUMENTS}, None),
    ("/score", {"text_1": QUERY}, "text_2"),
    ("/score", {"text_1": QUERY, "text_2": DOCUMENTS, "queries": QUERY, "documents": DOCUMENTS}, "text_1"),
    ("/rerank", {"query": QUERY, "documents": []}, "documents"),
    ("/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": -1}, "top_n"),
    ("/rerank", {"query": "z" * 600, "documents": DOCUMENTS}, "documents"),
    ("/rerank", {"query": QUERY, "documents": [[]]}, "documents"),
    ("/rerank", {"query": QUERY, "documents": [[5, 6]]}, "documents"),  # a text query, a token-id document
    ("/score", {"text_1": QUERY, "text_2": ["z" * 600]}, "text_2"),
    ("/v1/embeddings", {"input": QUERY}, "model"),
])
def test_bad_requests_are_400s_naming_the_field(server, path, body, param):
    status, response = server.request("POST", path, body)
    assert status == 400, response
    assert response["error"]["type"] == "invalid_request_error"
    if param is not None:
        assert response["error"]["param"] == param, response


def test_qwen3_reranker_through_hf_overrides_serves_the_model_card_scores(tmp_path):
    path = write_tiny_base(str(tmp_path / "causal"), seed=7)
    queries = f"<Query>: {QUERY}\n"
    documents = [f"<Document>: {document}" for document in DOCUMENTS]
    with LLM(path, hf_overrides=RERANKER, **SETTINGS) as llm:
        expected = [output.outputs.score for output in llm.score(queries, documents, use_tqdm=False)]
    for server in running_server(path, "--dtype", "float32", "--hf-overrides", json.dumps(RERANKER)):
        status, response = server.request("POST", "/rerank", {"query": queries, "documents": documents})
        assert status == 200, response
        scores = {result["index"]: result["relevance_score"] for result in response["results"]}
        assert [scores[i] for i in range(len(DOCUMENTS))] == pytest.approx(expected, abs=1e-6)
