"""../shared/bench/llamacpp/convert_novocab.py for a Llama folder too: the same empty vocabulary for llama.cpp's
LlamaModel (its converter only patches Qwen3's), then that script as is. Same usage:
  python convert_novocab_llama.py LLAMA_CPP_DIR HF_FOLDER OUT.gguf [f32|f16|q8_0]"""
import os
import runpy
import sys

CONVERTER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "bench",
                         "llamacpp", "convert_novocab.py")
sys.path[:0] = [sys.argv[1], os.path.join(sys.argv[1], "gguf-py")]
import conversion.llama as llama  # noqa: E402  (llama.cpp's converter package)


def set_vocab_none(self):
    self._set_vocab_none()
    self.gguf_writer.add_vocab_size(self.hparams["vocab_size"])


llama.LlamaModel.set_vocab = set_vocab_none
runpy.run_path(CONVERTER, run_name="__main__")
