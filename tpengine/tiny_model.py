"""Tiny random-weight checkpoints with a byte-level tokenizer: the embedded demo model (Qwen3) and test fixtures
of every supported family.

Written with transformers itself (`Qwen3ForCausalLM(config).save_pretrained`, ...), deterministically
from a seed, so no download is ever needed. The text such a model writes is meaningless.
"""
import functools
import hashlib
import json
import os
import shutil
import tempfile

from tpengine.cache import cache_dir

EOS_TOKEN = "<|endoftext|>"

# The embedded default model: small enough to start in a second on a laptop CPU.
DEFAULT_TINY_CONFIG = dict(
    vocab_size=320, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, rope_theta=1_000_000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=0.1,
)
TINY_MODEL_VERSION = "2"  # 2: the tokenizer has a chat template

# ChatML, the format Qwen models use, so `tpengine serve` chats with the embedded model out of the box.
# Its markers are plain text to the byte tokenizer.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def write_byte_tokenizer(path: str, bos_token: str | None = None, special_tokens: tuple[str, ...] = (),
                         chat_template: str = CHATML_TEMPLATE) -> int:
    """A byte-level BPE tokenizer with no merges (one token per byte) plus an EOS token; returns its size.

    With bos_token, that token follows EOS and the tokenizer prepends it to every text, as Llama 3's does.
    special_tokens follow them (an image model's <|image_pad|>, say), each one token wherever a text holds it.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([EOS_TOKEN] + ([bos_token] if bos_token else []) + list(special_tokens))
    if bos_token:
        bos = (bos_token, tokenizer.token_to_id(bos_token))
        tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos_token} $A", pair=f"{bos_token} $A $B",
                                                                 special_tokens=[bos])
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN, bos_token=bos_token,
                            chat_template=chat_template).save_pretrained(path)
    return tokenizer.get_vocab_size()


# Written checkpoints are kept by their arguments in cache_dir(CACHE_FOLDER), up to this size: importing transformers
# and building the model takes seconds, copying a few megabytes milliseconds (the test suite writes the same small
# models over and over, in one subprocess after another). TPENGINE_TINY_MODEL_CACHE=0 turns it off.
CACHE_FOLDER = "tiny-models"
CACHE_MAX_BYTES = 64 * 2**20
MANIFEST = "MANIFEST.json"


def write_tiny_model(path: str, *, seed: int = 0, with_tokenizer: bool = True, architecture: str = "Qwen3ForCausalLM",
                     bos_token: str | None = None, **overrides) -> str:
    """Write a random-weight checkpoint (safetensors) of a transformers architecture to path; overrides change
    the config. Biases, which transformers initialises to zero (gpt-oss's experts' *_proj_bias too), are drawn at
    random too, so they count.

    The files are the same for the same arguments (and the same transformers, torch, tokenizers and this module), so
    a checkpoint up to CACHE_MAX_BYTES is written once into the cache folder and copied (never linked: callers may
    rewrite the files) from there after, without importing transformers; torch's random state is left as the writing
    leaves it (seeded, then drawn from), as a caller's later draws may count on it."""
    args = dict(seed=seed, with_tokenizer=with_tokenizer, architecture=architecture, bos_token=bos_token, **overrides)
    key = cache_key(**args)
    if key is None:
        return _write_tiny_model(path, **args)
    entry = cache_dir(CACHE_FOLDER, key)
    files, rng_state = _read_cache_entry(entry)
    if files is None:
        try:
            os.makedirs(cache_dir(CACHE_FOLDER), exist_ok=True)
            staging = tempfile.mkdtemp(prefix=".staging-", dir=cache_dir(CACHE_FOLDER))
        except OSError:  # an unwritable cache folder: write as without the cache
            return _write_tiny_model(path, **args)
        try:
            _write_tiny_model(staging, **args)
            files = _store_cache_entry(staging, entry, path)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        if files is None:  # too big to keep, or not flat files: already moved into path
            return path
    else:
        import torch
        torch.manual_seed(seed)  # the CUDA generators too, as the writing does
        torch.set_rng_state(torch.tensor(list(rng_state), dtype=torch.uint8))
    os.makedirs(path, exist_ok=True)
    for name, data in files.items():
        with open(os.path.join(path, name), "wb") as f:
            f.write(data)
    return path


def cache_key(**args) -> str | None:
    """The cache entry's name for write_tiny_model's arguments (path aside), or None where it is not to be cached:
    the cache turned off, an override JSON cannot hold, or a package missing."""
    if os.environ.get("TPENGINE_TINY_MODEL_CACHE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    try:
        versions = _package_versions()
        text = json.dumps(dict(args=args, version=TINY_MODEL_VERSION, source=_source_digest(), packages=versions),
                          sort_keys=True, allow_nan=True)
    except (TypeError, ValueError, OSError, ImportError):
        return None
    return f"{args['architecture']}-{hashlib.sha256(text.encode()).hexdigest()[:40]}"


@functools.cache
def _source_digest() -> str:
    """This file's digest: a change to the default config, the tokenizer or the writing retires the old entries."""
    with open(__file__, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _package_versions() -> dict[str, str]:
    from importlib.metadata import version  # the installed versions, without importing the packages
    return {name: version(name) for name in ("transformers", "torch", "tokenizers", "safetensors")}


def _read_cache_entry(entry: str) -> tuple[dict[str, bytes] | None, bytes | None]:
    """An entry's files (name -> contents) and torch's random state after the writing, if its manifest is there and
    every file matches it; else None, None (and a broken entry is removed, so the next write replaces it)."""
    try:
        with open(os.path.join(entry, MANIFEST)) as f:
            manifest = json.load(f)
        digests, rng_state = manifest["files"], bytes.fromhex(manifest["rng_state"])
        if not isinstance(digests, dict) or not digests or set(digests) != set(os.listdir(entry)) - {MANIFEST}:
            raise ValueError("the files are not the manifest's")
        files = {}
        for name, digest in digests.items():
            with open(os.path.join(entry, name), "rb") as f:
                files[name] = f.read()
            if hashlib.sha256(files[name]).hexdigest() != digest:
                raise ValueError(f"{name} is not the file written")
        return files, rng_state
    except FileNotFoundError:
        if os.path.isdir(entry):  # a manifest or a file gone
            shutil.rmtree(entry, ignore_errors=True)
        return None, None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # json's errors are ValueErrors
        shutil.rmtree(entry, ignore_errors=True)
        return None, None


def _store_cache_entry(staging: str, entry: str, path: str) -> dict[str, bytes] | None:
    """Keep staging's files as entry (renamed whole: a reader sees a complete entry or none, and of two processes
    writing the same one the first to rename wins) and return them; too big or not flat files, move them into path
    instead and return None."""
    names = sorted(os.listdir(staging))
    if (not all(os.path.isfile(os.path.join(staging, name)) for name in names)
            or sum(os.path.getsize(os.path.join(staging, name)) for name in names) > CACHE_MAX_BYTES):
        os.makedirs(path, exist_ok=True)
        for name in names:
            shutil.move(os.path.join(staging, name), os.path.join(path, name))
        return None
    import torch  # imported by the writing
    files = {}
    for name in names:
        with open(os.path.join(staging, name), "rb") as f:
            files[name] = f.read()
    try:
        with open(os.path.join(staging, MANIFEST), "w") as f:
            json.dump(dict(files={name: hashlib.sha256(data).hexdigest() for name, data in files.items()},
                           rng_state=bytes(torch.get_rng_state().tolist()).hex()), f, indent=1)
        os.rename(staging, entry)
    except OSError:  # another process kept it first, or the cache folder is full: the files are in hand anyway
        pass
    return files


def _write_tiny_model(path: str, *, seed: int, with_tokenizer: bool, architecture: str, bos_token: str | None,
                      **overrides) -> str:
    """write_tiny_model's writing, with transformers."""
    import torch
    import transformers

    os.makedirs(path, exist_ok=True)
    settings = {**DEFAULT_TINY_CONFIG, **overrides}
    if with_tokenizer:
        num_tokens = write_byte_tokenizer(path, bos_token)
        if settings["vocab_size"] < num_tokens:
            raise ValueError(f"vocab_size={settings['vocab_size']} is smaller than the byte tokenizer's {num_tokens}")
        settings.setdefault("eos_token_id", 256)  # the byte tokenizer's EOS follows its 256 bytes
        settings.setdefault("bos_token_id", num_tokens - 1)
    model_class = getattr(transformers, architecture)
    config = model_class.config_class(**settings)
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith((".bias", "_proj_bias")):
                param.normal_(0.0, config.initializer_range)
        for name, buffer in model.named_buffers():  # DeepSeek V3's routing bias, a saved buffer
            if name.endswith(".e_score_correction_bias"):
                buffer.normal_(0.0, config.initializer_range)
    if getattr(model, "generation_config", None) is not None:  # a classifier (no generate) has none
        model.generation_config.eos_token_id = config.eos_token_id
    model.save_pretrained(path, safe_serialization=True)
    return path


def default_model_path() -> str:
    """The embedded default model, written on first use into the user's cache folder."""
    cache = cache_dir()
    path = os.path.join(cache, f"tiny-qwen3-v{TINY_MODEL_VERSION}")
    if not os.path.exists(os.path.join(path, "config.json")):
        import sys
        print(f"tpengine: writing the embedded tiny random-weight Qwen3 model to {path} "
              "(its text is meaningless; pass --model for a real checkpoint)", file=sys.stderr)
        os.makedirs(cache, exist_ok=True)
        staging = tempfile.mkdtemp(dir=cache)  # written aside, then renamed: concurrent first runs stay safe
        write_tiny_model(staging)
        try:
            os.rename(staging, path)
        except OSError:  # another process got there first
            shutil.rmtree(staging, ignore_errors=True)
    return path


def write_layer_draft(model: str, path: str, num_layers: int) -> str:
    """Write a draft model for speculative decoding made of a checkpoint's own first num_layers decoder layers,
    with its embedding, final norm and LM head (a layer-skipped self-draft): it shares the vocabulary and
    tokenizer. How often it agrees with the whole model depends on how much the skipped layers move the
    residual stream: on random weights, barely ever (benchmarks/bench_spec.py measures it)."""
    import torch
    from transformers import AutoModelForCausalLM

    draft = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    if not 1 <= num_layers <= draft.config.num_hidden_layers:
        raise ValueError(f"num_layers={num_layers} must be 1 to the model's {draft.config.num_hidden_layers} layers")
    draft.model.layers = draft.model.layers[:num_layers]
    draft.config.num_hidden_layers = num_layers
    if getattr(draft.config, "layer_types", None) is not None:
        draft.config.layer_types = draft.config.layer_types[:num_layers]
    draft.save_pretrained(path, safe_serialization=True)
    for name in os.listdir(model):  # the tokenizer's files
        if name.startswith(("tokenizer", "vocab", "merges", "special_tokens")):
            shutil.copy(os.path.join(model, name), path)
    return path
