"""Chat messages -> prompt token ids through the model's (or the user's) Jinja chat template: the one rendering
the server (/v1/chat/completions) and LLM.chat share."""
import json
import os
import sys
from typing import Any

from tpengine.errors import InvalidRequestError


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file holding a Jinja template, or the template itself."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" in value:  # inline Jinja, as vLLM also accepts
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")


def render_chat(tokenizer, chat_template: str | None, messages: list[dict[str, Any]],
                add_generation_prompt: bool, template_kwargs: dict[str, Any] | None) -> list[int]:
    """Prompt token ids for messages. InvalidRequestError when there is no template or it rejects them."""
    return encode_chat_text(tokenizer, render_chat_text(tokenizer, chat_template, messages, add_generation_prompt,
                                                        template_kwargs))


def encode_chat_text(tokenizer, text: str, add_special_tokens: bool = False) -> list[int]:
    # The template writes any BOS itself: adding special tokens again would double it, unless a request asks.
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def render_chat_text(tokenizer, chat_template: str | None, messages: list[dict[str, Any]],
                     add_generation_prompt: bool, template_kwargs: dict[str, Any] | None,
                     tools: list[dict] | None = None) -> str:
    """The prompt text for messages, as OpenAI shapes them (tool-call arguments as JSON text).
    InvalidRequestError when there is no template or it rejects them."""
    if tokenizer is None:
        raise InvalidRequestError("this model folder has no tokenizer, so chat is unavailable: use "
                                  "/v1/completions with token ids", "messages")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("this model has no chat template: start the server with --chat-template FILE",
                                  "messages")
    from jinja2 import TemplateError
    try:
        return tokenizer.apply_chat_template([_template_message(m) for m in messages], chat_template=chat_template,
                                             tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **(template_kwargs or {}))
    except TemplateError as e:
        raise InvalidRequestError(f"the chat template rejected the messages: {e}", "messages") from None
    except TypeError as e:  # a chat_template_kwargs key that apply_chat_template itself takes
        raise InvalidRequestError(f"chat_template_kwargs: {e}", "chat_template_kwargs") from None
    except RecursionError:  # messages, tools or template variables nested deeper than the template's walk
        raise InvalidRequestError(f"the messages, tools or chat_template_kwargs nest deeper than the chat template "
                                  f"can read (about {sys.getrecursionlimit()} levels)", "messages") from None


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    """The message as chat templates read it: an assistant's tool-call arguments as objects (OpenAI sends them as
    JSON text; templates write them out as JSON). The caller's message is left as it was."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    parsed = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                call = {**call, "function": {**function, "arguments": json.loads(function["arguments"])}}
            except ValueError:
                pass  # not JSON: the template gets the text
        parsed.append(call)
    return {**message, "tool_calls": parsed}
