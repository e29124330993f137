"""Prompts to token ids off the event loop: encoding and chat templates run on one thread of their own.

A request's text is checked against what could possibly fit before anything tokenizes it: no token
covers more characters than the vocabulary's longest token, so a text longer than max_request_len
times that cannot fit and is refused at once (vLLM bounds prompts the same way). What may fit is
tokenized on the renderer's thread, with its own tokenizer instance (a Rust tokenizer must not be
used from two threads at once), so the event loop keeps answering (/health, streams) meanwhile. A short
text is tokenized on the event loop itself, with the loop's own instance: handing it to the thread and
back took longer than encoding it.
"""
import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tpengine.entrypoints.chat_template import encode_chat_text, render_chat_text
from tpengine.errors import InvalidRequestError

# text prompts of at most this many characters in all are encoded on the event loop (about 0.1 ms for 256 characters
# of a byte-level BPE), not on the renderer's thread: the hop there and back cost 0.15 ms and more on the request's
# path (docs/benchmarks.md)
INLINE_ENCODE_CHARS = 2048


def max_chars_per_token(tokenizer) -> int:
    """The most characters of text one token can stand for: its longest vocabulary entry (byte-level
    vocabularies write a byte as one character, so a multi-byte character reads as longer, never shorter)."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1)


class PromptRenderer:
    def __init__(self, tokenizer, chat_template: str | None, max_request_len: int, loop_tokenizer=None):
        self.tokenizer = tokenizer    # used by the renderer's thread only
        self.loop_tokenizer = loop_tokenizer  # the event loop's own instance: short prompts encode there
        self.chat_template = chat_template
        self.max_request_len = max_request_len
        self.max_chars = None if tokenizer is None else max_request_len * max_chars_per_token(tokenizer)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="tpengine-renderer")

    def check_length(self, num_chars: int, param: str) -> None:
        """Refuse text that cannot fit the request limit in any tokenization."""
        if self.max_chars is not None and num_chars > self.max_chars:
            raise InvalidRequestError(
                f"{param} has {num_chars} characters, more than could fit in the server's limit of "
                f"{self.max_request_len} tokens per request (no token of this model covers more than "
                f"{self.max_chars // self.max_request_len} characters)", param)

    async def encode(self, texts: list[str], limit_length: bool = True,
                     add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text prompt, as LLM.generate encodes them; limit_length=False: a text that cannot
        fit is still tokenized (an embedding input that will be truncated); add_special_tokens=False: no BOS."""
        for text in texts:
            if limit_length:
                self.check_length(len(text), "prompt")
        if self.loop_tokenizer is not None and sum(map(len, texts)) <= INLINE_ENCODE_CHARS:
            return self._encode_all(texts, add_special_tokens, self.loop_tokenizer)
        return await self.run(self._encode_all, texts, add_special_tokens)

    def _encode_all(self, texts: list[str], add_special_tokens: bool = True, tokenizer=None) -> list[list[int]]:
        from tpengine.engine.inputs import encode_text
        tokenizer = self.tokenizer if tokenizer is None else tokenizer
        return [encode_text(tokenizer, text, add_special_tokens) for text in texts]

    async def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                          template_kwargs: dict[str, Any] | None, tools: list[dict] | None = None,
                          add_special_tokens: bool = False, expand_text=None) -> list[int]:
        """Prompt token ids for chat messages (and the tools the model may call) through the chat template;
        add_special_tokens: the tokenizer's special tokens (BOS) on top of what the template writes; expand_text:
        the rendered text's image placeholders written out before tokenizing (ImagePrompts.expand_text)."""
        self.check_length(sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str)), "messages")
        return await self.run(self._render, messages, add_generation_prompt, template_kwargs, tools,
                              add_special_tokens, expand_text)

    def _render(self, messages, add_generation_prompt, template_kwargs, tools, add_special_tokens=False,
                expand_text=None) -> list[int]:
        text = render_chat_text(self.tokenizer, self.chat_template, messages, add_generation_prompt, template_kwargs,
                                tools)
        self.check_length(len(text), "messages")  # the template and chat_template_kwargs add text of their own
        if expand_text is not None:
            text = expand_text(text)
        return encode_chat_text(self.tokenizer, text, add_special_tokens)

    def warm_up(self) -> None:
        """(the renderer's thread) A first encode and chat render: the tokenizer's and the template's one-time
        costs (a Jinja template compiles on its first render), paid before the server reports ready; the event
        loop's tokenizer's first encode too (nothing uses it before the server is ready)."""
        self._encode_all(["warm-up"])
        if self.loop_tokenizer is not None:
            self._encode_all(["warm-up"], tokenizer=self.loop_tokenizer)
        if self.chat_template is not None or getattr(self.tokenizer, "chat_template", None):
            self._render([{"role": "user", "content": "warm-up"}], True, None, None)

    async def run(self, fn, *args):
        """fn(*args) on the renderer's thread (work that grows with a request, kept off the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
