"""Tiny random embedding checkpoints laid out as Qwen3-Embedding ships them, and sentence-transformers as the oracle.

A checkpoint is a tiny random decoder (the byte tokenizer, tests/lora/adapters.py's TINY_BASE) plus
sentence-transformers' files: modules.json (Transformer, Pooling, Normalize), 1_Pooling/config.json,
sentence_bert_config.json and config_sentence_transformers.json. As Qwen3-Embedding's tokenizer does, a
last-token checkpoint's tokenizer appends EOS (<|endoftext|>) to every text, so the pooled token is EOS."""
import json
import os

import numpy as np

from tests.lora.adapters import write_tiny_base
from tpengine.tiny_model import EOS_TOKEN

POOLING_FLAGS = {"lasttoken": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens",
                 "cls": "pooling_mode_cls_token"}
ST_MODULES = "sentence_transformers.models"
MAX_SEQ_LENGTH = 1024  # TINY_BASE's max_position_embeddings


def write_tiny_embedding_model(path: str, pooling: str = "lasttoken", normalize: bool = True,
                               matryoshka_dimensions: list[int] | None = None, seed: int = 0,
                               architecture: str = "Qwen3ForCausalLM", append_eos: bool | None = None,
                               bare_weights: bool = False, **config_overrides) -> str:
    """A tiny random checkpoint with sentence-transformers' pooling files; returns path.

    pooling: "lasttoken", "mean" or "cls"; append_eos (default: for last-token pooling) makes the tokenizer end
    every text with EOS, as Qwen3-Embedding's does; matryoshka_dimensions marks config.json is_matryoshka with
    those dimensions, as vLLM reads it; bare_weights saves the weights as Qwen3-Embedding's are (the decoder's
    alone, without the causal LM's "model." prefix, its embeddings tied, no LM head)."""
    if pooling not in POOLING_FLAGS:
        raise ValueError(f"pooling={pooling!r} is not one of {sorted(POOLING_FLAGS)}")
    if bare_weights:
        config_overrides["tie_word_embeddings"] = True
    write_tiny_base(path, architecture=architecture, seed=seed, **config_overrides)
    if bare_weights:
        _strip_lm_head(path)
    _finish_tokenizer(path, pooling == "lasttoken" if append_eos is None else append_eos)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    if matryoshka_dimensions is not None:
        config.update(is_matryoshka=True, matryoshka_dimensions=list(matryoshka_dimensions))
        _write_json(os.path.join(path, "config.json"), config)
    modules = [{"idx": 0, "name": "0", "path": "", "type": f"{ST_MODULES}.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": f"{ST_MODULES}.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": f"{ST_MODULES}.Normalize"})
        os.makedirs(os.path.join(path, "2_Normalize"), exist_ok=True)
    _write_json(os.path.join(path, "modules.json"), modules)
    pooling_config = {"word_embedding_dimension": config["hidden_size"],
                      **{flag: False for flag in POOLING_FLAGS.values()}, "pooling_mode_max_tokens": False,
                      "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
                      "include_prompt": True}
    pooling_config[POOLING_FLAGS[pooling]] = True
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    _write_json(os.path.join(path, "1_Pooling", "config.json"), pooling_config)
    _write_json(os.path.join(path, "sentence_bert_config.json"),
                {"max_seq_length": MAX_SEQ_LENGTH, "do_lower_case": False})
    _write_json(os.path.join(path, "config_sentence_transformers.json"),
                {"prompts": {"query": "", "document": ""}, "default_prompt_name": None,
                 "similarity_fn_name": "cosine"})
    return path


def _strip_lm_head(path: str) -> None:
    """model.safetensors as a decoder saved on its own: "model.layers.0..." becomes "layers.0...", no lm_head."""
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    bare = {name.removeprefix("model."): tensor for name, tensor in tensors.items() if not name.startswith("lm_head.")}
    save_file(bare, file, metadata={"format": "pt"})


def _finish_tokenizer(path: str, append_eos: bool) -> None:
    """Pad with EOS (sentence-transformers pads batches; Qwen3's pad token is <|endoftext|> too) and, with
    append_eos, end every encoded text with EOS."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.pad_token = EOS_TOKEN
    if append_eos:
        eos = (EOS_TOKEN, tokenizer.convert_tokens_to_ids(EOS_TOKEN))
        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=f"$A {EOS_TOKEN}", pair=f"$A {EOS_TOKEN} $B {EOS_TOKEN}", special_tokens=[eos])
    tokenizer.save_pretrained(path)


def _write_json(path: str, value) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=2)


def load_st_model(path: str, truncate_dim: int | None = None):
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(path, device="cpu", truncate_dim=truncate_dim)


def st_embed(path_or_model, texts: list[str], truncate_dim: int | None = None) -> np.ndarray:
    """sentence-transformers' embeddings of texts (float32, one row each); one text a batch, so no padding."""
    model = load_st_model(path_or_model, truncate_dim) if isinstance(path_or_model, str) else path_or_model
    embeddings = model.encode(texts, batch_size=1, convert_to_numpy=True, truncate_dim=truncate_dim)
    return np.asarray(embeddings, dtype=np.float32)


def st_embed_token_ids(path_or_model, prompts: list[list[int]]) -> np.ndarray:
    """sentence-transformers' modules run on given token ids (no tokenizer): the oracle for token prompts and
    for truncated ones."""
    import torch

    model = load_st_model(path_or_model) if isinstance(path_or_model, str) else path_or_model
    rows = []
    with torch.no_grad():
        for token_ids in prompts:
            features = {"input_ids": torch.tensor([token_ids]), "attention_mask": torch.ones(1, len(token_ids),
                                                                                            dtype=torch.long)}
            rows.append(model(features)["sentence_embedding"][0].float().numpy())
    return np.stack(rows)


def st_token_ids(path_or_model, text: str) -> list[int]:
    """The token ids sentence-transformers feeds its model for text."""
    model = load_st_model(path_or_model) if isinstance(path_or_model, str) else path_or_model
    features = model.preprocess([text])
    return features["input_ids"][0][features["attention_mask"][0].bool()].tolist()


def cosine(a, b) -> np.ndarray:
    """Row-wise cosine similarity of two (n, d) arrays."""
    a, b = np.atleast_2d(np.asarray(a, np.float64)), np.atleast_2d(np.asarray(b, np.float64))
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def write_tiny_classifier(path: str, num_labels: int = 1, seed: int = 0,
                          architecture: str = "Qwen3ForSequenceClassification", **config_overrides) -> str:
    """A tiny random *ForSequenceClassification checkpoint (a cross-encoder reranker's layout: the decoder and a
    score head of num_labels, no LM head) with the byte tokenizer; returns path."""
    id2label = {str(i): f"LABEL_{i}" for i in range(num_labels)}
    return write_tiny_base(path, architecture=architecture, seed=seed, num_labels=num_labels,
                           id2label=id2label, label2id={v: int(k) for k, v in id2label.items()}, **config_overrides)
