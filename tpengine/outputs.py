"""What step() and generate() hand back, with vLLM's names: one RequestOutput per request, one
CompletionOutput per sample of it. Cheap to build every step, and msgspec can encode them."""
import dataclasses

import msgspec

# The finish_reason of a completion for which no token could be sampled (never a user's doing): the model's logits
# were not finite, or the sampling constraints left no token (a grammar that only a stop token could end, which
# min_tokens rules out, ends with "stop" instead)
NO_TOKEN = "error"
NO_TOKEN_MESSAGE = ("no token could be sampled: the model's logits were not finite (NaN or Inf), or the request's "
                    "constraints left no token")


class CompletionOutput:
    """One completion so far. A streamed one is built every step, so the engine hands it its
    sequence's append-only token list (and logprob list) with where this snapshot ends instead of a
    copy: `token_ids` and `logprobs` are sliced on first read, and always show exactly what was there
    when the snapshot was taken. Built by hand (CompletionOutput(index=..., token_ids=[...], ...)) it
    is a plain record."""

    __slots__ = ("index", "text", "_token_ids", "finish_reason", "stop_reason", "_logprobs", "cumulative_logprob",
                 "_token_source", "_token_start", "_token_end", "_logprob_source", "_logprob_start", "_logprob_end")

    def __init__(self, *, index: int, text: str | None, token_ids: list[int], finish_reason: str | None,
                 stop_reason: int | str | None = None, logprobs: list[dict[int, float]] | None = None,
                 cumulative_logprob: float | None = None):
        self.index = index                          # which of the request's n completions
        self.text = text                            # None when the model folder has no tokenizer
        self._token_ids = token_ids
        self.finish_reason = finish_reason          # "stop", "length", "abort", "error" (NO_TOKEN); None while running
        self.stop_reason = stop_reason              # the stop string or stop token id that ended it; None for EOS/length
        self._logprobs = logprobs                   # per token: token id -> log-probability, if asked
        self.cumulative_logprob = cumulative_logprob    # sum of the sampled tokens' log-probabilities, if asked
        self._token_source = self._logprob_source = None

    # A snapshot (completion_snapshot) sets _token_ids on first read, and _logprobs too when it has a source.
    @property
    def token_ids(self) -> list[int]:
        if self._token_source is not None:
            self._token_ids = self._token_source[self._token_start:self._token_end]
            self._token_source = None
        return self._token_ids

    @token_ids.setter
    def token_ids(self, value: list[int]) -> None:
        self._token_ids, self._token_source = value, None

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        if self._logprob_source is not None:
            self._logprobs = self._logprob_source[self._logprob_start:self._logprob_end]
            self._logprob_source = None
        return self._logprobs

    @logprobs.setter
    def logprobs(self, value: list[dict[int, float]] | None) -> None:
        self._logprobs, self._logprob_source = value, None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _fields(self) -> tuple:
        return tuple(getattr(self, name) for name in _COMPLETION_FIELDS)

    def __eq__(self, other):
        if type(other) is not type(self):
            return NotImplemented
        return self._fields() == other._fields()

    __hash__ = None

    def __repr__(self) -> str:
        return "CompletionOutput(" + ", ".join(f"{name}={getattr(self, name)!r}" for name in _COMPLETION_FIELDS) + ")"

    def __copy__(self) -> "CompletionOutput":
        return CompletionOutput(**{name: getattr(self, name) for name in _COMPLETION_FIELDS})

    def __reduce__(self):
        return _completion_output, self._fields()


@dataclasses.dataclass(kw_only=True)
class _CompletionFields:
    # The public fields, in order: CompletionOutput lends this dataclass's field table so that
    # msgspec (and dataclasses.fields / asdict) see a record of exactly these, read by attribute.
    index: int
    text: str | None
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None


_COMPLETION_FIELDS = tuple(f.name for f in dataclasses.fields(_CompletionFields))
CompletionOutput.__dataclass_fields__ = _CompletionFields.__dataclass_fields__
CompletionOutput.__dataclass_params__ = _CompletionFields.__dataclass_params__
CompletionOutput.__match_args__ = _COMPLETION_FIELDS
CompletionOutput.__annotations__ = dict(_CompletionFields.__annotations__)  # for msgspec.decode(type=...)


_new_object = object.__new__


def completion_snapshot(index: int, text: str | None, token_source: list[int], token_start: int, token_end: int,
                        finish_reason: str | None, stop_reason: int | str | None,
                        logprob_source: list | None = None, cumulative_logprob: float | None = None,
                        logprob_start: int = 0) -> CompletionOutput:
    """The engine's CompletionOutput: token_ids is token_source[token_start:token_end], logprobs (when
    logprob_source is given) logprob_source[logprob_start:] as it holds now; both lists are only ever appended
    to, so slicing them later gives what they held now. A function that sets only what a read needs: one is
    built per streamed completion per step."""
    self = _new_object(CompletionOutput)
    self.index, self.text, self.finish_reason, self.stop_reason = index, text, finish_reason, stop_reason
    self._token_source, self._token_start, self._token_end = token_source, token_start, token_end
    self._logprob_source, self.cumulative_logprob = logprob_source, cumulative_logprob
    if logprob_source is None:
        self._logprobs = None
    else:
        self._logprob_start, self._logprob_end = logprob_start, len(logprob_source)
    return self


def _completion_output(*fields) -> CompletionOutput:
    return CompletionOutput(**dict(zip(_COMPLETION_FIELDS, fields)))


class RequestOutput(msgspec.Struct, kw_only=True, gc=False):
    # gc=False: one is built per streamed request per step; it holds no cycles (its lists hold ids and outputs)
    request_id: int
    prompt: str | list[int] | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int              # prompt tokens served from the prefix cache
    # per prompt token: its logprob and the top alternatives (token id -> logprob); None for the first token and
    # unless SamplingParams.prompt_logprobs asked
    prompt_logprobs: list[dict[int, float] | None] | None = None

    # Shortcuts to the first completion (what a request with n=1 has).
    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


def merge_deltas(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """Two DELTA outputs of one request, the newer after the older, as one: each completion's text, token
    ids and logprobs joined, the newer's state (finish reasons, cumulative logprob, finished)."""
    completions = {completion.index: completion for completion in older.outputs}
    for new in newer.outputs:
        old = completions.get(new.index)
        if old is None:
            completions[new.index] = new
            continue
        completions[new.index] = CompletionOutput(
            index=new.index, text=None if new.text is None else (old.text or "") + new.text,
            token_ids=old.token_ids + new.token_ids, finish_reason=new.finish_reason, stop_reason=new.stop_reason,
            logprobs=None if new.logprobs is None else (old.logprobs or []) + new.logprobs,
            cumulative_logprob=new.cumulative_logprob)
    return RequestOutput(request_id=newer.request_id, prompt=newer.prompt, prompt_token_ids=newer.prompt_token_ids,
                         outputs=sorted(completions.values(), key=lambda c: c.index), finished=newer.finished,
                         num_cached_tokens=newer.num_cached_tokens,
                         prompt_logprobs=newer.prompt_logprobs or older.prompt_logprobs)


class EmbeddingOutput(msgspec.Struct, gc=False):
    embedding: list[float]


class EmbeddingRequestOutput(msgspec.Struct, kw_only=True, gc=False):
    """An embedding request's one output (vLLM's): its prompt and the pooled, maybe normalized, vector."""
    request_id: int
    prompt: str | list[int] | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


class ClassificationOutput(msgspec.Struct, gc=False):
    probs: list[float]  # per label: softmax (sigmoid for one label), or logits where use_activation=False


class ClassificationRequestOutput(msgspec.Struct, kw_only=True, gc=False):
    """A classification request's one output (vLLM's): its prompt and its classifier's label scores."""
    request_id: int
    prompt: str | list[int] | None
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True


class ScoringOutput(msgspec.Struct, gc=False):
    score: float


class ScoringRequestOutput(msgspec.Struct, kw_only=True, gc=False):
    """One (query, document) pair's score (vLLM's): a classifier's probability for the pair's prompt, or the cosine
    similarity of an embedding model's two vectors; prompt_token_ids: the pair's prompt, or the two joined."""
    request_id: int
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True
