"""POST /score and /rerank, as vLLM serves them: (query, document) pairs scored by a classifier (a cross-encoder
reranker: each pair one prompt) or by an embedding model (the cosine of the two embeddings), tpengine/scoring.py's
rules, with the engine's steps shared with any other request."""
from starlette.requests import Request

from tpengine.entrypoints.protocol import RerankRequest, ScoreRequest
from tpengine.entrypoints.serving import ApiError, OpenAIServing, cancel_on_disconnect, final_outputs, new_response_fields
from tpengine.sampling_params import PoolingParams
from tpengine.scoring import classifier_scores, cosine_scores, pair_prompt, score_pairs


class OpenAIServingScore(OpenAIServing):
    def request_field(self, param: str | None, request) -> str | None:
        """A refused prompt or pair is the documents' fault (or the query's, whose length they share)."""
        documents = "documents" if isinstance(request, RerankRequest) else "text_2"
        return documents if param in (None, "prompt") else param

    async def create_score(self, request: ScoreRequest, raw_request: Request):
        self.check_model(request.model)
        try:
            queries, documents = request.pair_inputs()
        except ValueError as e:
            raise self.invalid(e, request) from None
        scores = await cancel_on_disconnect(raw_request, self._scores(queries, documents, request))
        data = [{"index": index, "object": "score", "score": score} for index, score in enumerate(scores[0])]
        return {**new_response_fields("score", self.response_model(request.model)), "object": "list", "data": data,
                "usage": {"prompt_tokens": scores[1], "total_tokens": scores[1], "completion_tokens": 0}}

    async def create_rerank(self, request: RerankRequest, raw_request: Request):
        self.check_model(request.model)
        documents = request.document_inputs()
        scores, num_tokens = await cancel_on_disconnect(raw_request, self._scores(request.query, documents, request))
        ranked = sorted(range(len(documents)), key=lambda i: -scores[i])[:request.top_n or None]
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": _text(documents[i], self.tokenizer)}} if request.return_documents
                       else {})} for i in ranked]
        fields = new_response_fields("rerank", self.response_model(request.model))
        return {"id": fields["id"], "model": fields["model"], "results": results,
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}

    async def _scores(self, queries, documents, request) -> tuple[list[float], int]:
        """Each pair's score in document order, and the prompt tokens computed for them."""
        try:
            pairs = score_pairs(queries, documents)
            classifies = self.engine.engine.pooling.classifies
            params = PoolingParams(truncate_prompt_tokens=request.truncate_prompt_tokens,
                                   use_activation=request.use_activation, task="classify" if classifies else "embed")
            if classifies:  # one prompt per pair
                for query, document in pairs:
                    self._check_length(query, document)
                prompts = await self.renderer.run(_pair_prompts, self.renderer.tokenizer, pairs)
                scored = classifier_scores(await self._run(prompts, params, request))
            else:  # each text embedded, the pair's two vectors compared
                texts = [query for query, _ in pairs] + [document for _, document in pairs]
                for text in texts:
                    self._check_length(text)
                prompts = await self.renderer.run(_prompts, self.renderer.tokenizer, texts)
                outputs = await self._run(prompts, params, request)
                scored = cosine_scores(outputs[:len(pairs)], outputs[len(pairs):])
        except ValueError as e:
            raise self.invalid(e, request) from None
        return [output.outputs.score for output in scored], sum(len(prompt) for prompt in prompts)

    def _check_length(self, *texts) -> None:
        if self.tokenizer is None and any(isinstance(text, str) for text in texts):
            raise ApiError(400, "this model folder has no tokenizer: send queries and documents as token ids",
                           param="text_1")
        self.renderer.check_length(sum(len(text) for text in texts if isinstance(text, str)), "text_1")

    async def _run(self, prompts: list[list[int]], params: PoolingParams, request) -> list:
        outputs = await final_outputs(await self.submit(prompts, params, request))
        if len(outputs) != len(prompts) or not all(output.outputs.embedding for output in outputs.values()):
            raise ApiError(503, "the request was aborted before its scores were computed: the server is shutting "
                                "down", "service_unavailable", code="shutting_down")
        return [outputs[index] for index in range(len(prompts))]


def _pair_prompts(tokenizer, pairs) -> list[list[int]]:
    return [pair_prompt(tokenizer, query, document) for query, document in pairs]


def _prompts(tokenizer, texts) -> list[list[int]]:
    from tpengine.engine.inputs import encode_text
    return [text if isinstance(text, list) else encode_text(tokenizer, text) for text in texts]


def _text(document, tokenizer) -> str:
    return document if isinstance(document, str) else tokenizer.decode(document) if tokenizer is not None else ""
