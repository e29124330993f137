"""Grammars for structured outputs, parsed and compiled off the engine thread, cached by their canonical form.

xgrammar turns a StructuredOutputsParams (a JSON schema, any JSON object, a regex, a choice of strings, an
EBNF grammar) into a CompiledGrammar for this model's tokenizer: per grammar state, which token ids may
come next. A spec's size and nesting are bounded when it is made (structured/limits.py), so a parse and compile
take well under a second; each runs once, on one of a few threads of its own (xgrammar releases the GIL), so a
slow one delays only its own request, and a request whose grammar is not compiled within COMPILE_TIMEOUT_S fails
with a ValueError naming the limit. Compiled grammars are kept in a cache bounded by the bytes they hold.
"""
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError as FutureTimeout

import numpy as np
import xgrammar as xgr

from tpengine.errors import InvalidRequestError
from tpengine.sampling_params import StructuredOutputsParams
from tpengine.structured.utf8_guard import SurrogateGuard

# compiled grammars kept, by the bytes xgrammar says each holds (resident memory measures about 2.5 times that:
# benchmarks/soak_structured.py); beyond it the least recently used go
CACHE_LIMIT_BYTES = 128 * 1024 * 1024
# a request waits this long for its grammar before it fails (the bounded specs compile in well under a second)
COMPILE_TIMEOUT_S = 30.0
# parses and compiles at once: a slow one holds one thread, the others serve everyone else
COMPILE_THREADS = 4
# whitespace characters JSON may have between two tokens (llama.cpp's schema grammars allow a newline and an
# indent of up to 20): unbounded, a weak model can spend its whole budget on spaces inside `{`
MAX_JSON_WHITESPACE = 20
# xgrammar writes a length-bounded JSON string's characters (maxLength) as this class, which lets raw control
# characters through (invalid JSON: json.loads and JSON.parse refuse them); its unbounded strings use the
# strict class, which is put in its place
LOOSE_STRING_CHARACTER = r'[^\"\\\r\n]'
STRICT_STRING_CHARACTER = r'[^\0-\x1f\"\\\r\n]'
ANY_JSON_OBJECT = '{"type": "object"}'


def choice_regex(choices: tuple[str, ...]) -> str:
    """A regex matching exactly one of choices (vLLM compiles choice as this alternation)."""
    return "(" + "|".join(re.escape(choice) for choice in choices) + ")"


class CompiledGrammarCache:
    """Compiled grammars by their spec's key, least recently used first out once their bytes pass the limit."""

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[tuple, tuple[xgr.CompiledGrammar, int]] = OrderedDict()

    def get(self, key: tuple) -> xgr.CompiledGrammar | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: tuple, compiled: xgr.CompiledGrammar) -> None:
        if key in self._entries:
            return
        size = compiled.memory_size_bytes
        self._entries[key] = (compiled, size)
        self.num_bytes += size
        while self.num_bytes > self.limit_bytes and len(self._entries) > 1:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.num_bytes -= evicted

    def __len__(self) -> int:
        return len(self._entries)


class GrammarCompiler:
    """One per engine, on rank 0: parses and compiles the grammars of requests for its tokenizer."""

    def __init__(self, tokenizer_info: xgr.TokenizerInfo, cache_limit_bytes: int = CACHE_LIMIT_BYTES,
                 compile_timeout_s: float = COMPILE_TIMEOUT_S):
        self.tokenizer_info = tokenizer_info
        self.compile_timeout_s = compile_timeout_s
        # every completion's matcher masks, besides its grammar, the surrogates xgrammar lets through
        self.utf8_guard = SurrogateGuard(tokenizer_info.decoded_vocab, tokenizer_info.vocab_size)
        # xgrammar's own cache counts a fraction of what its entries hold: ours counts what each grammar says
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=2, cache_enabled=False)
        self._threads = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="tpengine-grammar")
        self._lock = threading.RLock()  # a compile already done runs its done callback under it
        self.cache = CompiledGrammarCache(cache_limit_bytes)  # under _lock
        self._compiling: dict[tuple, Future] = {}  # canonical key -> its compilation, until it is done

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int, stop_token_ids: frozenset[int]) -> "GrammarCompiler":
        """For a Hugging Face tokenizer, over the model's vocabulary (its LM head's rows, which may be more than
        the tokenizer's), its stop tokens the engine's EOS ids."""
        return cls(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                      stop_token_ids=sorted(stop_token_ids)))

    def compile(self, spec: StructuredOutputsParams, param: str = "structured_outputs") -> Future:
        """spec's compiled grammar, at once from the cache, else from the compile threads; a spec being compiled is
        not compiled twice. The future fails with InvalidRequestError (naming param) when the library rejects
        the grammar."""
        key = spec.key
        with self._lock:
            compiled = self.cache.get(key)
            if compiled is not None:
                future = Future()
                future.set_result(compiled)
                return future
            future = self._compiling.get(key)
            if future is None:
                future = self._threads.submit(self._compile, spec, param)
                self._compiling[key] = future
                future.add_done_callback(lambda _: self._done(key))
        return future

    def wait(self, future: Future, spec: StructuredOutputsParams,
             param: str = "structured_outputs") -> xgr.CompiledGrammar:
        """compile(spec)'s result: raises InvalidRequestError when it is rejected or not done in time."""
        try:
            return future.result(timeout=self.compile_timeout_s)
        except FutureTimeout:
            raise self.too_slow(spec, param) from None

    def too_slow(self, spec: StructuredOutputsParams, param: str) -> InvalidRequestError:
        return InvalidRequestError(f"{param}: the {spec.kind} did not compile within the limit of "
                                   f"{self.compile_timeout_s:g} s", param)

    def _done(self, key: tuple) -> None:
        with self._lock:
            future = self._compiling.pop(key, None)
            if future is not None and not future.cancelled() and future.exception() is None:
                self.cache.put(key, future.result())

    def _compile(self, spec: StructuredOutputsParams, param: str) -> xgr.CompiledGrammar:
        try:
            compiled = self._compiler.compile_grammar(self._grammar(spec))  # the spec's one parse
        except RuntimeError as e:  # xgrammar's parsers report what they reject as RuntimeError
            raise InvalidRequestError(f"{param}: the {spec.kind} was rejected: {_library_message(e)}", param) from None
        if not _can_start(compiled):
            raise InvalidRequestError(f"{param}: the {spec.kind} matches no text (no token can start it)", param)
        return compiled

    @staticmethod
    def _grammar(spec: StructuredOutputsParams) -> xgr.Grammar:
        kind = spec.kind
        if kind in ("json", "json_object"):
            json_format = dict(any_whitespace=False, separators=(",", ":")) if spec.disable_any_whitespace else \
                dict(max_whitespace_cnt=MAX_JSON_WHITESPACE)
            if kind == "json_object":  # any object: its properties and their values unconstrained
                return xgr.Grammar.from_json_schema(ANY_JSON_OBJECT, strict_mode=False, **json_format)
            return json_schema_grammar(spec.json, **json_format)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec.regex)
        if kind == "choice":
            return xgr.Grammar.from_regex(choice_regex(spec.choice))
        return xgr.Grammar.from_ebnf(spec.grammar)

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)


def _library_message(error: RuntimeError) -> str:
    message = str(error).splitlines()[0]
    message = message.split("] ", 1)[-1]  # drop xgrammar's log prefix: [time] file:line:
    return message.split(": ", 1)[-1]


def _can_start(compiled: xgr.CompiledGrammar) -> bool:
    """Whether a completion can begin under the grammar: some token allowed first, or the empty text matches."""
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    allowed = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:compiled.tokenizer_info.vocab_size]
    return bool(allowed.any()) or matcher.is_completed()


def json_schema_grammar(schema: str, **json_format) -> xgr.Grammar:
    """xgrammar's grammar for a JSON schema, its bounded strings held to JSON's characters."""
    ebnf = str(xgr.Grammar.from_json_schema(schema, **json_format))
    return xgr.Grammar.from_ebnf(ebnf.replace(LOOSE_STRING_CHARACTER, STRICT_STRING_CHARACTER))
