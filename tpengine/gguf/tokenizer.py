"""The tokenizer a GGUF file holds (`tokenizer.ggml.*`, with `tokenizer.chat_template`), built by transformers as a
fast tokenizer: the one `from_pretrained(dir, gguf_file=...)` loads beside the model."""
import os

from tpengine.gguf import gguf_files
from tpengine.gguf.files import open_gguf


def load_gguf_tokenizer(model: str | os.PathLike):
    """ValueError naming the key when the file holds no tokenizer (pass --tokenizer, then)."""
    first = gguf_files(model)[0]  # a split set keeps its metadata in its first file
    kind = open_gguf(model).metadata.get("tokenizer.ggml.model")
    if kind in (None, "none"):  # "none": written without a vocabulary (llama.cpp's converters for token-id use)
        raise ValueError(f"GGUF file {first!r} holds no tokenizer (tokenizer.ggml.model is {kind or 'absent'}): pass "
                         "tokenizer=PATH (--tokenizer), a folder with the model's tokenizer")
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(first)), gguf_file=os.path.basename(first))
    except (ValueError, KeyError, TypeError, NotImplementedError) as e:
        raise ValueError(f"GGUF file {first!r}: transformers cannot build its tokenizer: {e}") from None
