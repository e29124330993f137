"""Incremental detokenization and stop strings, on rank 0.

Per step a completion's text grows by its new tokens only: never a decode of the whole text.
Byte-level BPE tokenizers (GPT-2, Qwen, Llama 3) decode to the concatenation of each token's
bytes, so those bytes are looked up in a table and fed to an incremental UTF-8 decoder, which
holds back a character a later token completes. Other tokenizers decode a small window of
recent tokens (as vLLM does), reading on only when the window does not end in U+FFFD.
"""
from codecs import utf_8_decode

from tpengine.engine.stop_strings import StopMatcher, StopStrings

REPLACEMENT_CHAR = "\ufffd"
_WINDOW_CONTEXT_TOKENS = 5   # prompt tokens a window starts with: a leading space decodes as in context


def _byte_level_char_to_byte() -> dict[str, int]:
    # GPT-2's reversible byte <-> printable character map, which byte-level BPE vocabularies are written in
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _whole_characters(data: bytes) -> str | None:
    try:
        return data.decode()
    except UnicodeDecodeError:
        return None


class Detokenizer:
    """One per engine: turns token ids into text for any number of completions."""

    def __init__(self, tokenizer, vocab_size: int = 0):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size   # the model's: ids the tokenizer lacks decode to nothing, as in its decode
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.byte_level = (backend is not None and type(backend.decoder).__name__ == "ByteLevel"
                           and not getattr(tokenizer, "clean_up_tokenization_spaces", False))
        self._token_bytes: dict[bool, list[bytes]] = {}   # skip_special_tokens -> bytes per id
        self._token_texts: dict[bool, list[str | None]] = {}   # skip_special_tokens -> text per id

    def token_bytes(self, skip_special_tokens: bool) -> list[bytes]:
        """Each token id's bytes as the tokenizer's ByteLevel decoder writes them (built on first use)."""
        table = self._token_bytes.get(skip_special_tokens)
        if table is None:
            backend = self.tokenizer.backend_tokenizer
            special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
            char_to_byte = _byte_level_char_to_byte()
            table = []
            for i in range(max(self.vocab_size, backend.get_vocab_size(with_added_tokens=True))):
                token = backend.id_to_token(i)
                if token is None or (skip_special_tokens and i in special):
                    table.append(b"")
                elif all(c in char_to_byte for c in token):
                    table.append(bytes(char_to_byte[c] for c in token))
                else:  # the decoder's rule: a token outside the byte alphabet is its own UTF-8
                    table.append(token.encode())
            self._token_bytes[skip_special_tokens] = table
        return table

    def token_texts(self, skip_special_tokens: bool) -> list[str | None]:
        """Each token id's text where its bytes are whole UTF-8 characters (None where they are not): what a
        token appended to a text that holds back no partial character adds to it."""
        table = self._token_texts.get(skip_special_tokens)
        if table is None:
            table = [_whole_characters(data) for data in self.token_bytes(skip_special_tokens)]
            self._token_texts[skip_special_tokens] = table
        return table

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


class IncrementalText:
    """One completion's text, grown token by token, with its stop strings matched as it grows.

    `text` may end in a possible start of a stop string; `visible_text` holds that back, so every
    visible text is a prefix of the final one.
    """

    __slots__ = ("detokenizer", "skip_special_tokens", "stop", "include_stop", "text",
                 "_bytes", "_texts", "_undecoded", "_window", "_prefix_offset", "_read_offset")

    def __init__(self, detokenizer: Detokenizer, params, prompt_token_ids: list[int],
                 stops: StopStrings | None = None):
        """stops: the request's stop strings, shared by its completions (made here if not given)."""
        self.detokenizer = detokenizer
        self.skip_special_tokens = params.skip_special_tokens
        # None when there is none to match (no stop strings, or a text only completed at the end)
        self.stop = None if not params.stop else StopMatcher(stops or StopStrings(params.stop))
        self.include_stop = params.include_stop_str_in_output
        self.text = ""
        if detokenizer.byte_level:
            self._bytes = detokenizer.token_bytes(params.skip_special_tokens)
            self._texts = detokenizer.token_texts(params.skip_special_tokens)
            self._undecoded = b""  # the start of a character the next tokens complete
        else:
            self._bytes = None
            self._window = list(prompt_token_ids[-_WINDOW_CONTEXT_TOKENS:])
            self._prefix_offset, self._read_offset = 0, len(self._window)

    def append(self, token_ids: list[int], start: int, end: int, match_stop: bool = True) -> str | None:
        """Add token_ids[start:end] to the text; returns the stop string it now contains, if any (the
        text is then cut before it, or after it with include_stop_str_in_output)."""
        old_len = len(self.text)
        table = self._bytes
        if table is not None:
            # a decode step's token of whole characters after whole characters (nearly every step): no decoder
            piece = self._texts[token_ids[start]] if end - start == 1 and not self._undecoded else None
            if piece is not None:
                self.text += piece
            else:
                data = self._undecoded + b"".join([table[t] for t in token_ids[start:end]])
                # not final: an incomplete character at the end is left undecoded, invalid bytes become U+FFFD
                decoded, num_decoded = utf_8_decode(data, "replace", False)
                self._undecoded = data[num_decoded:]
                self.text += decoded
        else:
            self._window.extend(token_ids[start:end])
            self._read_window(final=False)
        if self.stop is None or len(self.text) == old_len:
            return None
        found = self.stop.feed(self.text, old_len, match_stop)
        if found is None:
            return None
        stop, at = found
        self.text = self.text[:at + len(stop)] if self.include_stop else self.text[:at]
        return stop

    def finish(self) -> None:
        """The completion ended without a stop string: flush what was held back (a character no later
        token completed becomes U+FFFD, as the tokenizer's own decode writes it)."""
        if self._bytes is not None:
            self.text += utf_8_decode(self._undecoded, "replace", True)[0]
            self._undecoded = b""
        else:
            self._read_window(final=True)

    def _read_window(self, final: bool) -> None:
        decode, skip = self.detokenizer.decode, self.skip_special_tokens
        window, prefix = self._window, self._prefix_offset
        prefix_text = decode(window[prefix:self._read_offset], skip)
        new_text = decode(window[prefix:], skip)
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith(REPLACEMENT_CHAR)):
            self.text += new_text[len(prefix_text):]
            self._prefix_offset, self._read_offset = self._read_offset, len(window)
            del window[:self._prefix_offset]  # keep the window short: cost per step stays per new token
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    @property
    def visible_text(self) -> str:
        """The text without a tail that may yet begin a stop string."""
        held_back = self.stop.num_held_back if self.stop is not None else 0
        return self.text[:len(self.text) - held_back] if held_back else self.text
