"""Per-request sampling settings (vLLM's fields and meanings), validated and normalized when they are made."""
import json as jsonlib
import math
import numbers
import struct
from copy import copy
from dataclasses import dataclass
from enum import Enum

from tpengine.errors import InvalidRequestError
from tpengine.structured.limits import MAX_SCHEMA_DEPTH, check_grammar_size, check_json_schema

MIN_TEMPERATURE = 1e-2   # below it logits / T overflow float32 on real models' logit ranges (vLLM's floor too)
MAX_LOGPROBS = 20
# Stop strings are matched as text grows (memory and time linear in them); these bound one request's
# share of the engine thread. OpenAI allows 4 strings; real delimiters are far shorter.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_LENGTH = 16384
MAX_LOGIT_BIAS = 100.0   # OpenAI's range for a logit_bias value: -100 bans a token, 100 all but forces it
# Token-id lists a request may carry: the sampler applies them to every step's logits.
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_STOP_TOKEN_IDS = 1024


class RequestOutputKind(Enum):
    """What a streamed request's outputs hold (vLLM's names): everything so far, only what is new since the
    last one, or nothing until the end."""
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def _float32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _invalid(name: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(message, name)


def _real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _invalid(name, f"{name} must be a number, got {value!r:.60}")
    return float(value)


def _integer(name: str, value) -> int:
    # bools are ints in Python but never a count; numpy integers are accepted
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _invalid(name, f"{name} must be an integer, got {value!r:.60}")
    return int(value)


def _logprob_count(name: str, value) -> int | None:
    """logprobs' or prompt_logprobs': None, or how many top alternatives besides the token itself."""
    if value is None:
        return None
    if not 0 <= _integer(name, value) <= MAX_LOGPROBS:
        raise _invalid(name, f"{name} must be None or in [0, {MAX_LOGPROBS}], got {value}")
    return int(value)


def _stop_strings(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    strings = (stop,) if isinstance(stop, str) else stop
    if not isinstance(strings, (list, tuple)) or not all(isinstance(s, str) for s in strings):
        raise _invalid("stop", f"stop must be a string or a list of strings, got {stop!r:.60}")
    if any(s == "" for s in strings):
        raise _invalid("stop", "stop strings must not be empty")
    if len(strings) > MAX_STOP_STRINGS:
        raise _invalid("stop", f"stop has {len(strings)} strings, more than the limit of {MAX_STOP_STRINGS}")
    longest = max(map(len, strings), default=0)
    if longest > MAX_STOP_STRING_LENGTH:
        raise _invalid("stop", f"a stop string has {longest} characters, more than the limit of "
                               f"{MAX_STOP_STRING_LENGTH}")
    return tuple(strings)


def _token_ids(name: str, ids) -> tuple[int, ...]:
    if ids is None:
        return ()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple, set, frozenset)):
        raise _invalid(name, f"{name} must be a list of token ids, got {ids!r:.60}")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise _invalid(name, f"{name} has {len(ids)} token ids, more than the limit of {MAX_STOP_TOKEN_IDS}")
    ids = tuple(_integer(name, t) for t in ids)
    if any(t < 0 for t in ids):
        raise _invalid(name, f"{name} must be non-negative token ids, got {ids!r:.60}")
    return ids


def _logit_bias(bias) -> dict[int, float] | None:
    """{token id: bias}, ids as ints (JSON sends them as strings of digits), each bias within the range."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise _invalid("logit_bias", f"logit_bias must be a dict of token id -> bias, got {bias!r:.60}")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise _invalid("logit_bias", f"logit_bias has {len(bias)} entries, more than the limit of "
                                     f"{MAX_LOGIT_BIAS_ENTRIES}")
    normalized = {}
    for token, value in bias.items():
        if isinstance(token, str) and token.isascii() and token.isdigit():
            token = int(token)
        if isinstance(token, bool) or not isinstance(token, numbers.Integral) or token < 0:
            raise _invalid("logit_bias", f"logit_bias keys must be token ids (integers >= 0), got {token!r:.60}")
        value = _real("logit_bias", value)
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise _invalid("logit_bias", f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                         f"got {value!r} for token {token}")
        normalized[int(token)] = value
    return normalized or None


STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain a completion to a JSON schema, any JSON object, a regular expression, one of some strings, or
    an EBNF grammar (vLLM's names): exactly one of them. A grammar library (xgrammar) turns it into a token
    mask every step, so the output matches whatever the model's weights say."""
    json: str | dict | None = None          # a JSON schema (stored as its JSON text, key order kept)
    json_object: bool | None = None         # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None   # one of these strings
    grammar: str | None = None              # EBNF, as xgrammar reads it (GBNF-like)
    disable_any_whitespace: bool = False    # JSON without whitespace between its tokens (compact)

    def __post_init__(self):
        def invalid(message: str) -> InvalidRequestError:
            return _invalid("structured_outputs", f"structured_outputs: {message}")

        given = [kind for kind in STRUCTURED_OUTPUT_KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise invalid(f"give exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}, got "
                          f"{', '.join(given) or 'none'}")
        if self.json is not None:
            schema = self.json
            try:
                if isinstance(schema, str):
                    check_grammar_size(len(schema), "json schema")
                    schema = jsonlib.loads(schema)
                if not isinstance(schema, (dict, bool)):
                    raise ValueError(f"json must be a JSON schema (an object), got {type(schema).__name__}")
                check_json_schema(schema)  # its depth before dumps recurses into it
                text = jsonlib.dumps(schema, ensure_ascii=False)
                check_grammar_size(len(text), "json schema")
            except jsonlib.JSONDecodeError as e:
                raise invalid(f"json is not valid JSON: {e}") from None
            except RecursionError:  # json.loads of text nested past Python's recursion limit
                raise invalid(f"the json schema nests more than the limit of {MAX_SCHEMA_DEPTH} levels") from None
            except ValueError as e:
                raise invalid(str(e)) from None
            object.__setattr__(self, "json", text)
        if self.json_object is not None and self.json_object is not True:
            raise invalid(f"json_object must be true, got {self.json_object!r:.60}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise invalid(f"{name} must be a non-empty string, got {value!r:.60}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)) or not self.choice \
                    or not all(isinstance(c, str) and c for c in self.choice):
                raise invalid(f"choice must be a non-empty list of non-empty strings, got {self.choice!r:.60}")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name, what in (("regex", "regex"), ("grammar", "grammar"), ("choice", "choice")):
            value = getattr(self, name)
            if value is not None:
                try:
                    check_grammar_size(len(value) if isinstance(value, str) else sum(map(len, value)), what)
                except ValueError as e:
                    raise invalid(str(e)) from None
        if not isinstance(self.disable_any_whitespace, bool):
            raise invalid(f"disable_any_whitespace must be True or False, got {self.disable_any_whitespace!r:.60}")

    @property
    def kind(self) -> str:
        return next(kind for kind in STRUCTURED_OUTPUT_KINDS if getattr(self, kind) not in (None, False))

    @property
    def key(self) -> tuple:
        """The canonical form: equal keys compile to the same grammar (the compile cache's key)."""
        return self.kind, getattr(self, self.kind), self.disable_any_whitespace


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1                              # completions per prompt; they share the prompt's KV blocks
    temperature: float = 1.0                # 0 is greedy; else >= MIN_TEMPERATURE
    top_k: int = -1                         # -1: all tokens
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None                 # completion i of n uses seed + i
    max_tokens: int = 64
    min_tokens: int = 0                     # EOS, stop tokens and stop strings cannot end a completion before it
    stop: str | tuple[str, ...] | None = None   # stored as a tuple of strings
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None             # 0..20: the sampled token plus that many top alternatives
    # 0..20: each prompt token's logprob plus that many top alternatives (max_tokens=0 then scores the prompt alone)
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0           # -2..2, over generated tokens
    frequency_penalty: float = 0.0          # -2..2, over generated tokens
    repetition_penalty: float = 1.0         # > 0, over prompt and generated tokens (transformers' definition)
    skip_special_tokens: bool = True
    # token id -> bias in [-100, 100] added to its logit before penalties and sampling (greedy included)
    logit_bias: dict[int, float] | None = None
    # a streamed request's outputs: everything so far, only what is new, or only the last
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None   # a grammar every completion follows
    # a chat reply: with a reasoning parser, its first token may be <think>, opening thinking that its grammar waits
    # out (tpengine/thinking.py); a raw prompt's completion is answer from its first token
    may_open_thinking: bool = False

    def __post_init__(self):
        def set_(name, value):
            object.__setattr__(self, name, value)

        n = _integer("n", self.n)
        if n < 1:
            raise _invalid("n", f"n must be >= 1, got {n}")
        temperature = _real("temperature", self.temperature)
        if not temperature >= 0.0:
            raise _invalid("temperature", f"temperature must be >= 0 (0 means greedy), got {self.temperature!r}")
        if not (temperature == 0.0 or MIN_TEMPERATURE <= temperature < math.inf):
            raise _invalid("temperature", f"temperature must be 0 (greedy) or a finite value >= {MIN_TEMPERATURE} "
                                          f"(smaller ones overflow float32 logits), got {self.temperature!r}")
        top_k = _integer("top_k", self.top_k)
        if top_k != -1 and top_k < 1:
            raise _invalid("top_k", f"top_k must be -1 (disabled) or >= 1, got {top_k}")
        top_p = _real("top_p", self.top_p)
        if not (0.0 < top_p <= 1.0 and _float32(top_p) > 0.0):
            raise _invalid("top_p", f"top_p must be in (0, 1] and nonzero in float32 (>= 1.4e-45), got {self.top_p!r}")
        min_p = _real("min_p", self.min_p)
        if not 0.0 <= min_p <= 1.0:
            raise _invalid("min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        seed = None if self.seed is None else _integer("seed", self.seed)
        max_tokens = _integer("max_tokens", self.max_tokens)
        prompt_logprobs = _logprob_count("prompt_logprobs", self.prompt_logprobs)
        if max_tokens < (0 if prompt_logprobs is not None else 1):  # a prompt may be scored without a token
            raise _invalid("max_tokens", f"max_tokens must be an integer >= 1 (0 with prompt_logprobs), got "
                                         f"{max_tokens}")
        min_tokens = _integer("min_tokens", self.min_tokens)
        if not 0 <= min_tokens <= max_tokens:
            raise _invalid("min_tokens", f"min_tokens must be in [0, max_tokens={max_tokens}], got {min_tokens}")
        logprobs = _logprob_count("logprobs", self.logprobs)
        for name in ("presence_penalty", "frequency_penalty"):
            value = _real(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise _invalid(name, f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
            set_(name, value)
        repetition_penalty = _real("repetition_penalty", self.repetition_penalty)
        if not 0.0 < repetition_penalty < math.inf:
            raise _invalid("repetition_penalty",
                           f"repetition_penalty must be a finite value > 0, got {self.repetition_penalty!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise _invalid("structured_outputs", "structured_outputs must be a StructuredOutputsParams, got "
                                                 f"{type(self.structured_outputs).__name__}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise _invalid("output_kind", f"output_kind must be a RequestOutputKind, got {self.output_kind!r:.60}")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "may_open_thinking"):
            if not isinstance(getattr(self, name), bool):
                raise _invalid(name, f"{name} must be True or False, got {getattr(self, name)!r:.60}")
        for name, value in (("n", n), ("temperature", temperature), ("top_k", top_k), ("top_p", top_p),
                            ("min_p", min_p), ("seed", seed), ("max_tokens", max_tokens),
                            ("min_tokens", min_tokens), ("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs),
                            ("repetition_penalty", repetition_penalty), ("stop", _stop_strings(self.stop)),
                            ("stop_token_ids", _token_ids("stop_token_ids", self.stop_token_ids)),
                            ("logit_bias", _logit_bias(self.logit_bias))):
            set_(name, value)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def has_filter(self) -> bool:
        """top-k, top-p or min-p cuts the distribution."""
        return self.top_k != -1 or self.top_p < 1.0 or self.min_p > 0.0


POOLING_TASKS = ("embed", "classify")


@dataclass(frozen=True)
class PoolingParams:
    """An embedding or classification request's settings (vLLM's PoolingParams): dimensions keeps a Matryoshka
    model's first that many (before normalizing); normalize overrides the checkpoint's choice; truncate_prompt_tokens
    keeps the prompt's last that many tokens (-1: max_model_len's worth) instead of refusing a longer one;
    use_activation=False keeps a classifier's raw logits."""
    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    # a classifier's scores through the sigmoid (one label) or softmax (None: yes, vLLM's default); False: logits
    use_activation: bool | None = None
    # what the caller wants of the model (vLLM's, set by embed / classify / score): an embedding model embeds, a
    # classifier classifies; the other is a ValueError
    task: str = "embed"

    def __post_init__(self):
        if self.dimensions is not None and _integer("dimensions", self.dimensions) < 1:
            raise _invalid("dimensions", f"dimensions must be an integer >= 1, got {self.dimensions!r}")
        if self.task not in POOLING_TASKS:
            raise _invalid("task", f"task must be one of {POOLING_TASKS}, got {self.task!r}")
        for name in ("normalize", "use_activation"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise _invalid(name, f"{name} must be True, False or None, got {getattr(self, name)!r}")
        truncate = self.truncate_prompt_tokens
        if truncate is not None and (_integer("truncate_prompt_tokens", truncate) < 1 and truncate != -1):
            raise _invalid("truncate_prompt_tokens", f"truncate_prompt_tokens must be -1 or an integer >= 1, got "
                                                     f"{truncate!r}")


@dataclass(frozen=True)
class BeamSearchParams:
    """LLM.beam_search's settings: vLLM's fields, and transformers' beam search (num_beams=beam_width,
    do_sample=False) as their meaning, early_stopping included (which vLLM's lacks)."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False                # EOS is then a token like any other: every beam runs to max_tokens
    temperature: float = 0.0                # 0 only: the search is deterministic
    length_penalty: float = 1.0             # a finished beam scores cum_logprob / num_output_tokens ** length_penalty
    include_stop_str_in_output: bool = False    # a beam's text keeps its final EOS token's text
    # transformers': False stops once the best running beam, scored at its present length, cannot beat the
    # worst of beam_width finished ones; True once beam_width have finished; "never" only when none can
    early_stopping: bool | str = False

    def __post_init__(self):
        beam_width = _integer("beam_width", self.beam_width)
        if not 1 <= beam_width <= MAX_LOGPROBS:
            raise _invalid("beam_width", f"beam_width must be in [1, {MAX_LOGPROBS}] (each beam's candidates are its "
                                         f"logprobs, at most {MAX_LOGPROBS}), got {beam_width}")
        max_tokens = _integer("max_tokens", self.max_tokens)
        if max_tokens < 1:
            raise _invalid("max_tokens", f"max_tokens must be an integer >= 1, got {max_tokens}")
        if _real("temperature", self.temperature) != 0.0:
            raise _invalid("temperature", "beam search is deterministic here (transformers' do_sample=False): "
                                          f"temperature must be 0, got {self.temperature!r}")
        length_penalty = _real("length_penalty", self.length_penalty)
        if not math.isfinite(length_penalty):
            raise _invalid("length_penalty", f"length_penalty must be finite, got {self.length_penalty!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise _invalid(name, f"{name} must be True or False, got {getattr(self, name)!r:.60}")
        if self.early_stopping not in (True, False, "never") or type(self.early_stopping) not in (bool, str):
            raise _invalid("early_stopping", f"early_stopping must be True, False or 'never', got "
                                             f"{self.early_stopping!r:.60}")
        for name, value in (("beam_width", beam_width), ("max_tokens", max_tokens), ("temperature", 0.0),
                            ("length_penalty", length_penalty)):
            object.__setattr__(self, name, value)


class SamplingRecord:
    """How one sequence samples, made once by the ledger when the sequence is queued: its request's
    settings (with this completion's seed), the token ids that stop it (EOS folded in unless ignored),
    and its token list, which the ledger only appends to: penalties read it, min_tokens counts it, and
    its length is the position a seeded draw depends on. The sampler reads this, never a Sequence."""

    __slots__ = ("params", "stop_token_ids", "token_ids", "num_prompt_tokens", "plain", "grammar", "offset")

    def __init__(self, params: SamplingParams, stop_token_ids: frozenset[int], token_ids: list[int],
                 num_prompt_tokens: int):
        self.params = params
        self.stop_token_ids = stop_token_ids
        self.token_ids = token_ids
        self.num_prompt_tokens = num_prompt_tokens
        # shaped by its temperature alone (greedy included), and by its grammar's token mask if it has one:
        # every rank can sample it over its own slice of the vocabulary, while min_tokens does not mask its
        # stop tokens (min_tokens_pending)
        self.plain = not (params.has_penalties or params.has_filter or params.logprobs is not None
                          or params.logit_bias is not None)
        # its grammar's matcher (structured outputs), which masks its logits and takes each sampled token
        self.grammar = None
        # how many tokens past the sequence's next one the row samples: a verify row's draft positions
        # (speculative decoding), whose seeded draws depend on the position they sample
        self.offset = 0

    def ahead(self, offset: int) -> "SamplingRecord":
        """The record of the row that samples offset tokens past the next one. Only for requests without
        penalties or min_tokens (engine/proposer.py: speculates), which read the tokens before the row."""
        record = copy(self)
        record.offset = offset
        return record

    @property
    def min_tokens_pending(self) -> bool:
        """Whether the completion is still shorter than its min_tokens (its stop tokens are masked)."""
        min_tokens = self.params.min_tokens
        return bool(min_tokens) and len(self.token_ids) - self.num_prompt_tokens < min_tokens
