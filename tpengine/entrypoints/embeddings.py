"""POST /v1/embeddings, as OpenAI and vLLM serve it: text or token-id inputs, one or a batch, pooled as the
checkpoint says (tpengine/pooling.py); vectors as JSON floats or base64 of little-endian float32 (what the
openai client asks for, and decodes, when its caller names no encoding_format)."""
import base64

import numpy as np
from starlette.requests import Request

from tpengine.entrypoints.protocol import EmbeddingRequest
from tpengine.entrypoints.serving import (ApiError, OpenAIServing, cancel_on_disconnect, final_outputs,
                                          new_response_fields)
from tpengine.outputs import EmbeddingRequestOutput
from tpengine.sampling_params import PoolingParams


def encode_embedding(embedding: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")
    return embedding


class OpenAIServingEmbedding(OpenAIServing):
    async def create(self, request: EmbeddingRequest, raw_request: Request):
        self.check_model(request.model)
        prompts = await self._encode(request)
        try:
            params = PoolingParams(dimensions=request.dimensions, truncate_prompt_tokens=request.truncate_prompt_tokens)
        except ValueError as e:  # PoolingParams names the bad value and its limit
            raise self.invalid(e, request) from None
        submission = await self.submit(prompts, params, request)
        fields = {**new_response_fields("embd", self.response_model(request.model)), "object": "list"}
        return await cancel_on_disconnect(raw_request, self._respond(request, submission, fields))

    def request_field(self, param: str | None, request: EmbeddingRequest) -> str | None:
        return "input" if param == "prompt" else param  # the engine and the renderer call an input a prompt

    async def _encode(self, request: EmbeddingRequest) -> list[list[int]]:
        """Every input's token ids; text inputs are tokenized together, off the event loop."""
        inputs = request.inputs
        texts = [text for text in inputs if isinstance(text, str)]
        if not texts:
            return inputs
        if self.tokenizer is None:
            raise ApiError(400, "this model folder has no tokenizer: send inputs as token ids", param="input")
        if not all(texts):
            raise ApiError(400, "input is empty: it needs at least one token", param="input")
        try:
            # an input to be truncated is tokenized whatever its length
            encoded = iter(await self.renderer.encode(texts, limit_length=request.truncate_prompt_tokens is None))
        except ValueError as e:
            raise self.invalid(e, request) from None
        return [next(encoded) if isinstance(text, str) else text for text in inputs]

    async def _respond(self, request: EmbeddingRequest, submission, fields: dict) -> dict:
        outputs: dict[int, EmbeddingRequestOutput] = await final_outputs(submission)
        if not all(output.outputs.embedding for output in outputs.values()):  # aborted by the server's shutdown
            raise ApiError(503, "the request was aborted before its embeddings were computed: the server is "
                                "shutting down", "service_unavailable", code="shutting_down")
        data = [{"object": "embedding", "index": index,
                 "embedding": encode_embedding(output.outputs.embedding, request.encoding_format)}
                for index, output in sorted(outputs.items())]
        num_prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs.values())
        return {**fields, "data": data, "usage": {"prompt_tokens": num_prompt_tokens,
                                                  "total_tokens": num_prompt_tokens}}
