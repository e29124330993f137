"""Per-request sampling settings (vLLM's fields and meanings), validated and normalized when they are made."""
import math
import numbers
import struct
from dataclasses import dataclass

MIN_TEMPERATURE = 1e-2   # below it logits / T overflow float32 on real models' logit ranges (vLLM's floor too)
MAX_LOGPROBS = 20


def _float32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def _integer(name: str, value) -> int:
    # bools are ints in Python but never a count; numpy integers are accepted
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


def _stop_strings(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    strings = (stop,) if isinstance(stop, str) else stop
    if not isinstance(strings, (list, tuple)) or not all(isinstance(s, str) for s in strings):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    if any(s == "" for s in strings):
        raise ValueError("stop strings must not be empty")
    return tuple(strings)


def _token_ids(name: str, ids) -> tuple[int, ...]:
    if ids is None:
        return ()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple, set, frozenset)):
        raise ValueError(f"{name} must be a list of token ids, got {ids!r}")
    ids = tuple(_integer(name, t) for t in ids)
    if any(t < 0 for t in ids):
        raise ValueError(f"{name} must be non-negative token ids, got {ids!r}")
    return ids


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
    presence_penalty: float = 0.0           # -2..2, over generated tokens
    frequency_penalty: float = 0.0          # -2..2, over generated tokens
    repetition_penalty: float = 1.0         # > 0, over prompt and generated tokens (transformers' definition)
    skip_special_tokens: bool = True

    def __post_init__(self):
        def set_(name, value):
            object.__setattr__(self, name, value)

        n = _integer("n", self.n)
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        temperature = _real("temperature", self.temperature)
        if not temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature!r}")
        if not (temperature == 0.0 or MIN_TEMPERATURE <= temperature < math.inf):
            raise ValueError(f"temperature must be 0 (greedy) or a finite value >= {MIN_TEMPERATURE} "
                             f"(smaller ones overflow float32 logits), got {self.temperature!r}")
        top_k = _integer("top_k", self.top_k)
        if top_k != -1 and top_k < 1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {top_k}")
        top_p = _real("top_p", self.top_p)
        if not (0.0 < top_p <= 1.0 and _float32(top_p) > 0.0):
            raise ValueError(f"top_p must be in (0, 1] and nonzero in float32 (>= 1.4e-45), got {self.top_p!r}")
        min_p = _real("min_p", self.min_p)
        if not 0.0 <= min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        seed = None if self.seed is None else _integer("seed", self.seed)
        max_tokens = _integer("max_tokens", self.max_tokens)
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens}")
        min_tokens = _integer("min_tokens", self.min_tokens)
        if not 0 <= min_tokens <= max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={max_tokens}], got {min_tokens}")
        logprobs = None if self.logprobs is None else _integer("logprobs", self.logprobs)
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be None or in [0, {MAX_LOGPROBS}], got {logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _real(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
            set_(name, value)
        repetition_penalty = _real("repetition_penalty", self.repetition_penalty)
        if not 0.0 < repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be a finite value > 0, got {self.repetition_penalty!r}")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name, value in (("n", n), ("temperature", temperature), ("top_k", top_k), ("top_p", top_p),
                            ("min_p", min_p), ("seed", seed), ("max_tokens", max_tokens),
                            ("min_tokens", min_tokens), ("logprobs", logprobs),
                            ("repetition_penalty", repetition_penalty), ("stop", _stop_strings(self.stop)),
                            ("stop_token_ids", _token_ids("stop_token_ids", self.stop_token_ids))):
            set_(name, value)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
