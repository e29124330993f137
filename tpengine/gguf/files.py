"""A GGUF checkpoint opened with the `gguf` package: its readers (memory-mapped), its metadata as Python values,
and its tensors by name. A split set keeps its metadata in the first file and its tensors spread over all."""
import os
from dataclasses import dataclass
from functools import cached_property

from tpengine.gguf import gguf_files


@dataclass(eq=False)
class GGUFCheckpoint:
    """The opened files of one GGUF checkpoint (gguf_files), read lazily: nothing is copied out of the maps."""
    path: str
    readers: list  # gguf.GGUFReader, one per file

    @cached_property
    def metadata(self) -> dict:
        """key -> value (str, int, float, bool, or a list of them) of the first file, as llama.cpp wrote it."""
        return {key: _value(field) for key, field in self.readers[0].fields.items() if not key.startswith("GGUF.")}

    @cached_property
    def tensors(self) -> dict:
        """name -> gguf.ReaderTensor, over every file of the set."""
        return {tensor.name: tensor for reader in self.readers for tensor in reader.tensors}

    def architecture(self) -> str:
        architecture = self.metadata.get("general.architecture")
        if not isinstance(architecture, str):
            raise ValueError(f"GGUF file {self.path!r} has no general.architecture key")
        return architecture


def _value(field):
    from gguf import GGUFValueType
    value = field.contents()
    if field.types and field.types[0] == GGUFValueType.ARRAY and not isinstance(value, list):
        return list(value)
    return value


def open_gguf(model: str | os.PathLike) -> GGUFCheckpoint:
    """The checkpoint at model, a .gguf file (or one file of a split set). ValueError naming the file when one is
    not a readable GGUF file (cut short, or not GGUF at all)."""
    from gguf import GGUFReader
    readers = []
    for file in gguf_files(model):
        try:
            readers.append(GGUFReader(file))
        except (ValueError, IndexError, KeyError, OSError, TypeError) as e:  # the reader's own checks, or a short map
            raise ValueError(f"{file} is not a readable GGUF file (cut short or corrupt): {e}") from None
    checkpoint = GGUFCheckpoint(os.fspath(model), readers)
    count = checkpoint.metadata.get("split.count", 1)
    if count != len(readers):
        raise ValueError(f"GGUF file {model!r}: split.count is {count}, but its name says {len(readers)} files")
    return checkpoint
