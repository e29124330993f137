"""GGUF files (llama.cpp's format) read as a checkpoint: one `.gguf` file or a split set (`-00001-of-0000N.gguf`).

files.py opens the set with the `gguf` package (llama.cpp's own reader, memory-mapped) and reads its metadata;
config.py turns the metadata into the config.json object hf_config.py parses; tensors.py names each tensor as the
Hugging Face checkpoint would and hands it over in the form it runs from (a float tensor, or a QuantizedWeight for
the block types that map onto one exactly). Nothing here but tensors.py imports torch: rank 0 reads the config
before any worker starts.
"""
import os
import re

GGUF_SUFFIX = ".gguf"
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def is_gguf(model: str | os.PathLike) -> bool:
    """Whether the model path names a GGUF file (rather than a checkpoint folder)."""
    return os.fspath(model).endswith(GGUF_SUFFIX)


def gguf_files(model: str | os.PathLike) -> list[str]:
    """The files of a GGUF checkpoint: the file itself, or every file of its split set, in order (any one of
    them may be named). ValueError naming the file that is missing."""
    model = os.fspath(model)
    match = _SPLIT.match(model)
    files = [model] if match is None else [
        f"{match['stem']}-{no:05d}-of-{match['count']}.gguf" for no in range(1, int(match["count"]) + 1)]
    for file in files:
        if not os.path.isfile(file):
            raise ValueError(f"GGUF file {file!r} does not exist" + ("" if file == model else
                                                                     f" (a part of the split set {model!r})"))
    return files
