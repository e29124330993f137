"""Scoring (query, document) pairs, as vLLM's LLM.score and /score, /rerank do: a classifier (a cross-encoder
reranker) scores each pair's one prompt, the query and the document tokenized as a pair; an embedding model scores
the cosine similarity of the two texts' embeddings. No torch: rank 0 builds the prompts and the scores."""
import math

from tpengine.outputs import ClassificationRequestOutput, EmbeddingRequestOutput, ScoringOutput, ScoringRequestOutput

ScoreInput = str | list[int]  # a text, or token ids


def score_pairs(queries, documents) -> list[tuple[ScoreInput, ScoreInput]]:
    """(query, document) pairs: one query against every document, or queries and documents one to one;
    ValueError naming the counts otherwise."""
    queries, documents = _items(queries, "queries"), _items(documents, "documents")
    if len(queries) == 1:
        queries = queries * len(documents)
    if len(queries) != len(documents):
        raise ValueError(f"got {len(queries)} queries for {len(documents)} documents: give one query, or one per "
                         "document")
    if not documents:
        raise ValueError("documents is empty: there is nothing to score")
    return list(zip(queries, documents))


def _items(value, name: str) -> list[ScoreInput]:
    if isinstance(value, str) or _is_token_ids(value):
        return [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) or _is_token_ids(v) for v in value):
        raise ValueError(f"{name} must be a text, token ids, or a list of them, got {type(value).__name__}")
    return list(value)


def _is_token_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def pair_prompt(tokenizer, query: ScoreInput, document: ScoreInput) -> list[int]:
    """A cross-encoder's prompt for the pair: the tokenizer's pair encoding of two texts (BERT's [CLS] q [SEP] d
    [SEP]; a decoder's q then d, as its post-processor joins a pair), or two token-id lists joined."""
    if isinstance(query, str) and isinstance(document, str):
        if tokenizer is None:
            raise ValueError("this model folder has no tokenizer: send the query and documents as token ids")
        return list(tokenizer(text=query, text_pair=document)["input_ids"])
    if isinstance(query, str) or isinstance(document, str):
        raise ValueError("a query and its document must both be texts or both be token ids")
    return [*query, *document]


def classifier_scores(outputs: list[ClassificationRequestOutput | EmbeddingRequestOutput]
                      ) -> list[ScoringRequestOutput]:
    """Each pair's score from its classified prompt: its one label's probability (sigmoid of the logit)."""
    scored = []
    for output in outputs:
        values = output.outputs.probs if isinstance(output, ClassificationRequestOutput) else output.outputs.embedding
        if len(values) != 1:
            raise ValueError(f"this classifier has {len(values)} labels: a score needs one (use classify() for "
                             "every label's probability)")
        scored.append(ScoringRequestOutput(request_id=output.request_id, prompt_token_ids=output.prompt_token_ids,
                                           outputs=ScoringOutput(values[0]), finished=output.finished))
    return scored


def cosine_scores(queries: list[EmbeddingRequestOutput], documents: list[EmbeddingRequestOutput]
                  ) -> list[ScoringRequestOutput]:
    """Each pair's cosine similarity of its two embeddings (an embedding model's score), in float64."""
    return [ScoringRequestOutput(request_id=document.request_id,
                                 prompt_token_ids=query.prompt_token_ids + document.prompt_token_ids,
                                 outputs=ScoringOutput(cosine(query.outputs.embedding, document.outputs.embedding)))
            for query, document in zip(queries, documents)]


def cosine(a: list[float], b: list[float]) -> float:
    norms = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return math.fsum(x * y for x, y in zip(a, b)) / norms if norms else 0.0
