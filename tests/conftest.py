"""Shared fixtures: tiny random checkpoints written by transformers, and transformers' greedy tokens."""
import functools
import os
import shutil

import torch

if not torch.cuda.is_available():
    # Triton kernels run on CPU only in the interpreter; set before anything imports triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tpengine.hf_config import HFConfig, parse_hf_config  # noqa: E402
from tpengine.tiny_model import write_tiny_model  # noqa: E402

# vocabulary not divisible by 4, 2 KV heads (replicated at tp=4), head_dim 48 (not a power of two), untied
TP_MODEL = dict(vocab_size=1003, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=48, max_position_embeddings=1024,
                tie_word_embeddings=False, initializer_range=0.1)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return write_tiny_model(str(tmp_path_factory.mktemp("tiny_qwen3")), seed=1, **TP_MODEL)


@pytest.fixture(scope="session")
def tied_model(tmp_path_factory) -> str:
    """The embedded default shape: tied embeddings, 4 layers, with its byte tokenizer."""
    return write_tiny_model(str(tmp_path_factory.mktemp("tiny_tied")), seed=2)


@functools.lru_cache(maxsize=None)
def _hf_model(path: str):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # compare full lengths; our side runs with ignore_eos
    return model


@functools.lru_cache(maxsize=None)
def _hf_greedy_one(path: str, prompt: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    model = _hf_model(path)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return tuple(out[0, len(prompt):].tolist())


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own greedy continuation of each prompt: the oracle."""
    return [list(_hf_greedy_one(path, tuple(p), max_new_tokens)) for p in prompts]


def as_hf_config(config) -> HFConfig:
    """A transformers config object as tpengine reads it from the config.json transformers writes."""
    return parse_hf_config(config.to_dict(), "config.json")


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| over max |ref|, in float64 on the host."""
    out, ref = out.double().cpu(), ref.double().cpu()
    return ((out - ref).abs().max() / ref.abs().max()).item()


def random_prompts(seed: int, lengths: list[int], vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(autouse=True, scope="session")
def _cpu_threads():
    # two cores: keep each test process from oversubscribing them
    torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def thinking_model(tied_model, tmp_path_factory) -> str:
    """The tied model, its tokenizer given the reasoning tokens <think> and </think> (as Qwen3's has)."""
    from transformers import AutoTokenizer
    path = str(tmp_path_factory.mktemp("thinking") / "model")
    shutil.copytree(tied_model, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens(["<think>", "</think>"])  # ids 257, 258: inside the model's 320-row vocabulary
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def nan_logits_model(tied_model, tmp_path_factory) -> str:
    """The tied model with a NaN final norm: every logit it makes is NaN (a corrupt checkpoint's symptom)."""
    from safetensors.torch import load_file, save_file
    path = str(tmp_path_factory.mktemp("nan_logits") / "model")
    shutil.copytree(tied_model, path)
    weights_file = next(os.path.join(path, name) for name in os.listdir(path) if name.endswith(".safetensors"))
    weights = load_file(weights_file)
    norm = next(name for name in weights if name.endswith("model.norm.weight"))
    weights[norm] = torch.full_like(weights[norm], float("nan"))
    save_file(weights, weights_file, metadata={"format": "pt"})
    return path
