"""LLM.score and LLM.classify against transformers (the oracle): a *ForSequenceClassification cross-encoder's
sigmoid (one label) and softmax (several), Qwen3-Reranker's yes/no scoring as its model card computes it (a causal
LM read with hf_overrides' classifier_from_token), and an embedding model's cosine against sentence-transformers;
at tp 1 and 2, through chunked prefill and prefix-cache hits; the ValueErrors."""
import numpy as np
import pytest
import torch

from tests.lora.adapters import write_tiny_base
from tests.pooling.models import cosine, st_embed, write_tiny_classifier, write_tiny_embedding_model
from tpengine import LLM, PoolingParams

# 16-token chunks and blocks: the longer pairs prefill over several steps
CHUNKED = dict(kvcache_block_size=16, max_num_batched_tokens=16, max_model_len=512, dtype="float32")
QUERY = "What is the capital of France?"
DOCUMENTS = ["Paris is the capital of France.", "Cats are small.",
             "Retrieval pipelines embed and rerank; evaluation harnesses score prompts, one context at a time.", "no"]
# Qwen3-Reranker's model card: its prompt around "<Instruct>: ...\n<Query>: ...\n<Document>: ...", scored by the
# probability of "yes" against "no" at the last position (here the byte tokenizer's "y" and "n")
PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
          "provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
RERANKER = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["n", "y"],
            "is_original_qwen3_reranker": True}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("scoring_models")
    return {"cross_encoder": write_tiny_classifier(str(root / "cross_encoder"), num_labels=1, seed=5),
            "three_labels": write_tiny_classifier(str(root / "three_labels"), num_labels=3, seed=6),
            "causal": write_tiny_base(str(root / "causal"), seed=7),
            "embedding": write_tiny_embedding_model(str(root / "embedding"), seed=8)}


def hf_logits(path: str, token_ids: list[int], causal: bool = False) -> torch.Tensor:
    import transformers
    auto = transformers.AutoModelForCausalLM if causal else transformers.AutoModelForSequenceClassification
    model = auto.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0]
    return logits[-1] if causal else logits


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_a_cross_encoders_scores_are_the_sigmoid_of_transformers_logits(checkpoints, tp):
    path = checkpoints["cross_encoder"]
    with LLM(path, tensor_parallel_size=tp, **CHUNKED) as llm:
        assert llm.config.runner == "pooling"  # a classifier runs as a pooling engine
        outputs = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
        again = llm.score(QUERY, DOCUMENTS, use_tqdm=False)  # the query's blocks now hit the prefix cache
        tokenizer = llm.get_tokenizer()
    for document, output, repeated in zip(DOCUMENTS, outputs, again):
        pair = tokenizer(text=QUERY, text_pair=document)["input_ids"]
        assert output.prompt_token_ids == pair
        expected = torch.sigmoid(hf_logits(path, pair)).item()
        assert output.outputs.score == pytest.approx(expected, abs=1e-5)
        assert repeated.outputs.score == pytest.approx(expected, abs=1e-5)


def test_classify_gives_the_softmax_of_every_label_or_the_logits(checkpoints):
    path = checkpoints["three_labels"]
    prompts = [QUERY, DOCUMENTS[2]]
    with LLM(path, task="classify", **CHUNKED) as llm:
        probs = llm.classify(prompts, use_tqdm=False)
        logits = llm.classify(prompts, pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
        with pytest.raises(ValueError, match="3 labels: a score needs one"):
            llm.score(QUERY, DOCUMENTS[:1], use_tqdm=False)
        with pytest.raises(ValueError, match="classifier .*does not embed"):
            llm.embed(QUERY, use_tqdm=False)
        with pytest.raises(ValueError, match="dimensions=8: this model is a classifier"):
            llm.classify(QUERY, pooling_params=PoolingParams(dimensions=8), use_tqdm=False)
        tokenizer = llm.get_tokenizer()
    for prompt, prob, logit in zip(prompts, probs, logits):
        expected = hf_logits(path, tokenizer.encode(prompt))
        np.testing.assert_allclose(logit.outputs.probs, expected.numpy(), atol=1e-5)
        np.testing.assert_allclose(prob.outputs.probs, torch.softmax(expected, -1).numpy(), atol=1e-6)


def model_card_score(path: str, tokenizer, query: str, document: str) -> float:
    """Qwen3-Reranker's model card: prefix + "<Instruct>: ...\\n<Query>: ...\\n<Document>: ..." + suffix, tokens
    joined; log-softmax of the ("no", "yes") logits at the last position; exp of yes's."""
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    body = f"<Instruct>: {INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
    logits = hf_logits(path, encode(PREFIX) + encode(body) + encode(SUFFIX), causal=True)
    no, yes = tokenizer.convert_tokens_to_ids(RERANKER["classifier_from_token"])
    return torch.log_softmax(logits[[no, yes]], dim=-1)[1].exp().item()


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_qwen3_reranker_scores_as_its_model_card_computes_them(checkpoints, tp):
    """vLLM's recipe: the causal checkpoint read as a classifier from its "no" and "yes" rows, the query and
    document formatted as the model card's prompt halves."""
    path = checkpoints["causal"]
    queries = f"{PREFIX}<Instruct>: {INSTRUCTION}\n<Query>: {QUERY}\n"
    documents = [f"<Document>: {document}{SUFFIX}" for document in DOCUMENTS]
    with LLM(path, hf_overrides=RERANKER, tensor_parallel_size=tp, **CHUNKED) as llm:
        outputs = llm.score(queries, documents, use_tqdm=False)
        computed = llm.prompt_tokens_total
        again = llm.score(queries, documents, use_tqdm=False)
        assert llm.prompt_tokens_total - computed < computed / 2  # the shared instruction and query are cached
        tokenizer = llm.get_tokenizer()
    for document, output, repeated in zip(DOCUMENTS, outputs, again):
        expected = model_card_score(path, tokenizer, QUERY, document)
        assert output.outputs.score == pytest.approx(expected, abs=1e-5)
        assert repeated.outputs.score == pytest.approx(expected, abs=1e-5)


def test_tokens_classify_across_vocabulary_shards_at_tp2(checkpoints):
    """One label per token past two: each its LM-head row, gathered from the rank whose shard holds it."""
    path = checkpoints["causal"]
    tokens = ["a", "<|endoftext|>", "z"]
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": tokens}
    with LLM(path, hf_overrides=overrides, tensor_parallel_size=2, **CHUNKED) as llm:
        outputs = llm.classify(DOCUMENTS, use_tqdm=False)
        tokenizer = llm.get_tokenizer()
    ids = tokenizer.convert_tokens_to_ids(tokens)
    for document, output in zip(DOCUMENTS, outputs):
        expected = torch.softmax(hf_logits(path, tokenizer.encode(document), causal=True)[ids], -1)
        np.testing.assert_allclose(output.outputs.probs, expected.numpy(), atol=1e-6)


def test_an_embedding_model_scores_the_cosine_of_its_embeddings(checkpoints):
    path = checkpoints["embedding"]
    with LLM(path, runner="pooling", **CHUNKED) as llm:
        outputs = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
        pairwise = llm.score([QUERY, DOCUMENTS[0]], DOCUMENTS[1:3], use_tqdm=False)
        with pytest.raises(ValueError, match="this model embeds"):
            llm.classify(QUERY, use_tqdm=False)
        with pytest.raises(ValueError, match="got 2 queries for 3 documents"):
            llm.score([QUERY, QUERY], DOCUMENTS[:3], use_tqdm=False)
    vectors = st_embed(path, [QUERY, *DOCUMENTS])
    np.testing.assert_allclose([o.outputs.score for o in outputs], cosine(vectors[:1], vectors[1:]), atol=1e-5)
    expected = cosine(vectors[[0, 1]], vectors[[2, 3]])
    np.testing.assert_allclose([o.outputs.score for o in pairwise], expected, atol=1e-5)


# every family's classifier, as transformers names it (Phi-3's pad id inside the vocabulary)
CLASSIFIERS = {"LlamaForSequenceClassification": {}, "Qwen2ForSequenceClassification": {},
               "MistralForSequenceClassification": {}, "Phi3ForSequenceClassification": dict(pad_token_id=0),
               "Gemma2ForSequenceClassification": {}, "Gemma3TextForSequenceClassification": {},
               "Qwen3MoeForSequenceClassification": dict(num_experts=4, num_experts_per_tok=2,
                                                         moe_intermediate_size=32)}


@pytest.mark.parametrize("architecture", list(CLASSIFIERS))
def test_every_familys_sequence_classifier_scores_as_transformers(tmp_path, architecture):
    path = write_tiny_classifier(str(tmp_path / "model"), seed=2, architecture=architecture,
                                 **CLASSIFIERS[architecture])
    with LLM(path, **CHUNKED) as llm:
        outputs = llm.score(QUERY, DOCUMENTS[:2], use_tqdm=False)
    for output in outputs:
        expected = torch.sigmoid(hf_logits(path, output.prompt_token_ids)).item()
        assert output.outputs.score == pytest.approx(expected, abs=1e-5)


def test_gemma3s_image_text_classifier_scores_its_text_model_as_transformers(tmp_path):
    """Gemma3ForSequenceClassification: the text model under text_config, the labels and score head outside it."""
    from transformers import Gemma3Config, Gemma3ForSequenceClassification
    from tpengine.tiny_model import write_byte_tokenizer
    path = str(tmp_path / "gemma3")
    write_byte_tokenizer(path)
    config = Gemma3Config(text_config=dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=16),
                          vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14),
                          mm_tokens_per_image=4, num_labels=1)
    torch.manual_seed(0)
    model = Gemma3ForSequenceClassification(config).float()
    model.save_pretrained(path)
    with LLM(path, **CHUNKED) as llm:
        outputs = llm.score(QUERY, DOCUMENTS[:2], use_tqdm=False)
    for output in outputs:
        with torch.no_grad():
            logit = model(input_ids=torch.tensor([output.prompt_token_ids])).logits[0, 0]
        assert output.outputs.score == pytest.approx(torch.sigmoid(logit).item(), abs=1e-5)


def test_a_classifier_token_the_tokenizer_lacks_is_a_value_error_before_any_worker(checkpoints):
    overrides = {**RERANKER, "classifier_from_token": ["no", "yes"]}  # the byte tokenizer has no such tokens
    with pytest.raises(ValueError, match=r"classifier_from_token \['no', 'yes'\] are not tokens"):
        LLM(checkpoints["causal"], hf_overrides=overrides, **CHUNKED)
