"""Tiny random-weight checkpoints with a byte-level tokenizer: the embedded demo model (Qwen3) and test fixtures
of every supported family.

Written with transformers itself (`Qwen3ForCausalLM(config).save_pretrained`, ...), deterministically
from a seed, so no download is ever needed. The text such a model writes is meaningless.
"""
import os
import shutil

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


def write_tiny_model(path: str, *, seed: int = 0, with_tokenizer: bool = True, architecture: str = "Qwen3ForCausalLM",
                     bos_token: str | None = None, **overrides) -> str:
    """Write a random-weight checkpoint (safetensors) of a transformers architecture to path; overrides change
    the config. Biases, which transformers initialises to zero (gpt-oss's experts' *_proj_bias too), are drawn at
    random too, so they count."""
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
        import tempfile
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
