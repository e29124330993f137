"""How an embedding is pooled from a checkpoint's last hidden states, read as sentence-transformers reads it
(modules.json: a Pooling module's config.json, and a Normalize module after it); a checkpoint without them is
pooled as vLLM pools a decoder's: its last token, normalized. A record (no torch): rank 0 checks requests against
it, every rank pools with it."""
import json
import os

import msgspec

from tpengine.errors import InvalidRequestError

POOLING_METHODS = ("last", "mean", "cls")
# 1_Pooling/config.json's flags, by the method they name (the other modes are not decoders' and are refused)
ST_POOLING_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
                    "pooling_mode_cls_token": "cls"}
UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


class PoolingConfig(msgspec.Struct, frozen=True):
    method: str = "last"
    normalize: bool = True
    # a classifier's outputs per prompt (its head on the last token: the vector is its logits, or with the
    # request's activation their sigmoid, one label, or softmax); 0: an embedding model
    # Matryoshka: a request may keep the first `dimensions` of the vector (any, or only these when listed)
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()
    num_labels: int = 0

    def checked(self, params, hidden_size: int) -> tuple[int, bool, bool]:
        """A PoolingParams' (dimensions kept, 0 for all; normalize; the classifier's activation), or ValueError naming
        what the model refuses."""
        if params.task != ("classify" if self.classifies else "embed"):
            raise InvalidRequestError(
                "this model is a classifier (a reranker): it classifies and scores (classify(), score(), /score, "
                "/rerank), it does not embed" if self.classifies else "this model embeds: it has no classifier "
                "head to classify with (score() compares its embeddings)", "model")
        if self.classifies:
            for name in ("dimensions", "normalize"):
                if getattr(params, name) is not None:
                    raise InvalidRequestError(f"{name}={getattr(params, name)!r}: this model is a classifier, whose "
                                              f"outputs are label scores, not an embedding", name)
            return 0, False, params.use_activation is not False
        if params.use_activation is not None:
            raise InvalidRequestError("use_activation applies to a classifier's scores; this model embeds",
                                      "use_activation")
        dimensions = params.dimensions
        if dimensions is not None:
            if not self.matryoshka:
                raise InvalidRequestError(f"dimensions={dimensions}: this model is not a Matryoshka model (its "
                                          "config.json has no is_matryoshka or matryoshka_dimensions), so its "
                                          "embeddings cannot be shortened", "dimensions")
            if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
                raise InvalidRequestError(f"dimensions={dimensions} is not one of the model's matryoshka_dimensions "
                                          f"{list(self.matryoshka_dimensions)}", "dimensions")
            if dimensions > hidden_size:
                raise InvalidRequestError(f"dimensions={dimensions} is more than the model's {hidden_size}",
                                          "dimensions")
        return dimensions or 0, self.normalize if params.normalize is None else params.normalize, False

    @property
    def classifies(self) -> bool:
        return self.num_labels > 0

    @property
    def reads_every_token(self) -> bool:
        """Mean and CLS pooling read hidden states of tokens a prefix-cache hit would skip: none is reused."""
        return self.method != "last"


def read_pooling_config(model: str, hf_config=None) -> PoolingConfig:
    """The checkpoint folder's pooling (a GGUF file, or a folder without sentence-transformers' files: the
    default); a classifier's (hf_config.is_classifier) is its last token's, unnormalized, through its head.
    ValueError for a pooling a decoder's embedding does not use."""
    if hf_config is not None and hf_config.is_classifier:
        return PoolingConfig(method="last", normalize=False, num_labels=hf_config.num_classifier_outputs)
    folder = model if os.path.isdir(model) else os.path.dirname(model)
    matryoshka, dimensions = _matryoshka(folder)
    modules = _read_json(folder, "modules.json")
    if not isinstance(modules, list):
        return PoolingConfig(matryoshka=matryoshka, matryoshka_dimensions=dimensions)
    types = [module.get("type", "") for module in modules if isinstance(module, dict)]
    pooling = next((m for m in modules if isinstance(m, dict) and m.get("type", "").endswith(".Pooling")), None)
    method = "last" if pooling is None else _method(folder, pooling.get("path", ""))
    normalize = any(kind.endswith(".Normalize") for kind in types)
    return PoolingConfig(method, normalize, matryoshka, dimensions)


def _method(folder: str, path: str) -> str:
    settings = _read_json(os.path.join(folder, path), "config.json") or {}
    for mode in UNSUPPORTED_MODES:
        if settings.get(mode):
            raise ValueError(f"{os.path.join(folder, path, 'config.json')}: {mode} is not supported; tpengine pools "
                             "by the last token, the mean or the first (CLS) token")
    methods = [method for mode, method in ST_POOLING_MODES.items() if settings.get(mode)]
    return methods[0] if methods else "last"


def _matryoshka(folder: str) -> tuple[bool, tuple[int, ...]]:
    config = _read_json(folder, "config.json") or {}
    dimensions = tuple(config.get("matryoshka_dimensions") or ())
    return bool(config.get("is_matryoshka")) or bool(dimensions), dimensions


def _read_json(folder: str, name: str):
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def classifier_token_ids(tokenizer_folder: str, tokens: list[str]) -> list[int]:
    """The ids of classifier_from_token's tokens in the tokenizer's vocabulary (as written there: Qwen's "yes");
    ValueError naming those it lacks."""
    from transformers import AutoTokenizer
    vocab = AutoTokenizer.from_pretrained(tokenizer_folder).get_vocab()
    missing = [token for token in tokens if token not in vocab]
    if missing:
        raise ValueError(f"classifier_from_token {missing} are not tokens of the tokenizer in {tokenizer_folder!r}")
    return [vocab[token] for token in tokens]
