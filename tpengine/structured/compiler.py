"""Grammars for structured outputs, compiled off the engine thread and cached by their canonical form.

xgrammar turns a StructuredOutputsParams (a JSON schema, any JSON object, a regex, a choice of strings, an
EBNF grammar) into a CompiledGrammar for this model's tokenizer: per grammar state, which token ids may
come next. Checking a grammar (parsing it into xgrammar's Grammar) is quick and is done when a request
is made, so a schema the library rejects is a ValueError naming the problem before anything is queued;
compiling it (its token masks over the whole vocabulary) is the slow part and runs on a thread of its
own, while the request waits unscheduled and nobody else waits for it.
"""
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import xgrammar as xgr

from tpengine.errors import InvalidRequestError
from tpengine.sampling_params import StructuredOutputsParams

# compiled grammars kept (xgrammar's cache of the compiler's results), beyond which the oldest go
CACHE_LIMIT_BYTES = 256 * 1024 * 1024
# xgrammar writes a length-bounded JSON string's characters (maxLength) as this class, which lets raw control
# characters through (invalid JSON: json.loads and JSON.parse refuse them); its unbounded strings use the
# strict class, which is put in its place
LOOSE_STRING_CHARACTER = r'[^\"\\\r\n]'
STRICT_STRING_CHARACTER = r'[^\0-\x1f\"\\\r\n]'


def choice_regex(choices: tuple[str, ...]) -> str:
    """A regex matching exactly one of choices (vLLM compiles choice as this alternation)."""
    return "(" + "|".join(re.escape(choice) for choice in choices) + ")"


class GrammarCompiler:
    """One per engine, on rank 0: checks and compiles the grammars of requests for its tokenizer."""

    def __init__(self, tokenizer_info: xgr.TokenizerInfo):
        self.tokenizer_info = tokenizer_info
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=2, cache_limit_bytes=CACHE_LIMIT_BYTES)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="tpengine-grammar")
        self._lock = threading.Lock()
        self._compiling: dict[tuple, Future] = {}  # canonical key -> its compilation, until it is done

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int, stop_token_ids: frozenset[int]) -> "GrammarCompiler":
        """For a Hugging Face tokenizer, over the model's vocabulary (its LM head's rows, which may be more than
        the tokenizer's), its stop tokens the engine's EOS ids."""
        return cls(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                      stop_token_ids=sorted(stop_token_ids)))

    def check(self, spec: StructuredOutputsParams, param: str = "structured_outputs") -> None:
        """Raise InvalidRequestError naming what the grammar library rejects in spec."""
        try:
            self._grammar(spec)
        except RuntimeError as e:  # xgrammar's parsers report what they reject as RuntimeError
            message = str(e).splitlines()[0]
            message = message.split("] ", 1)[-1]  # drop xgrammar's log prefix: [time] file:line:
            raise InvalidRequestError(f"{param}: the {spec.kind} was rejected: {message.split(': ', 1)[-1]}",
                                      param) from None

    def compile(self, spec: StructuredOutputsParams) -> Future:
        """The compiled grammar of spec, on the compiler's thread; a spec compiled before comes at once
        from xgrammar's cache, one being compiled is not compiled twice."""
        key = spec.key
        with self._lock:
            future = self._compiling.get(key)
            submitted = future is None
            if submitted:
                future = self._thread.submit(self._compile, spec)
                self._compiling[key] = future
        if submitted:
            # outside the lock: a compilation already done (xgrammar's cache answers in microseconds) runs its
            # callback here and now, and _forget takes the lock
            future.add_done_callback(lambda _: self._forget(key))
        return future

    def _forget(self, key: tuple) -> None:
        with self._lock:
            self._compiling.pop(key, None)  # done: xgrammar's own cache serves it from now on

    def _grammar(self, spec: StructuredOutputsParams) -> xgr.Grammar:
        kind = spec.kind
        if kind == "json":
            return json_schema_grammar(spec.json, **self._json_format(spec))
        if kind == "json_object":
            return xgr.Grammar.builtin_json_grammar()
        if kind == "regex":
            return xgr.Grammar.from_regex(spec.regex)
        if kind == "choice":
            return xgr.Grammar.from_regex(choice_regex(spec.choice))
        return xgr.Grammar.from_ebnf(spec.grammar)

    def _compile(self, spec: StructuredOutputsParams):
        return self._compiler.compile_grammar(self._grammar(spec))  # xgrammar caches by the grammar's text

    @staticmethod
    def _json_format(spec: StructuredOutputsParams) -> dict:
        # compact JSON when whitespace is not wanted; else any whitespace, as vLLM's default
        return dict(any_whitespace=False, separators=(",", ":")) if spec.disable_any_whitespace else {}

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


def json_schema_grammar(schema: str, **json_format) -> xgr.Grammar:
    """xgrammar's grammar for a JSON schema, its bounded strings held to JSON's characters."""
    ebnf = str(xgr.Grammar.from_json_schema(schema, **json_format))
    return xgr.Grammar.from_ebnf(ebnf.replace(LOOSE_STRING_CHARACTER, STRICT_STRING_CHARACTER))
