"""A checkpoint's config.json, read with json as transformers reads it, and what the shared decoder makes of it.

A key missing from config.json takes the default of its family's transformers config class (each family is
described in tpengine/families.py), so every field of HFConfig holds what AutoConfig gives
(tests/test_hf_config.py compares them field by field). Nothing here imports torch or transformers: rank 0
checks a checkpoint before any worker starts.
"""
import json
import math
import os
from dataclasses import dataclass, field, fields, replace

from tpengine.families import (ARCHITECTURES, CLASSIFIER_SUFFIX, FAMILIES, MODEL_TYPE_ALIASES, Family,
                               causal_architecture)
from tpengine.gguf import is_gguf

LAYER_TYPES = ("full_attention", "sliding_attention")
LEGACY_LAYER_TYPES = {"attention": "full_attention"}  # transformers renames these on load
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class HFConfig:
    """The fields of a checkpoint's config that the engine, the runner and the models read, under
    transformers' names, holding what transformers' config class holds after loading."""
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    # standardized as transformers 5 keeps it: rope_type and rope_theta always, whatever keys config.json used;
    # Gemma 3's holds one such dict per layer type ({"full_attention": {...}, "sliding_attention": {...}})
    rope_parameters: dict
    hidden_act: str | None = None               # the MLP's activation; None in Gemma's configs, which use:
    hidden_activation: str | None = None        # Gemma: the MLP's activation
    architectures: list[str] | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    dtype: str | None = None                    # "bfloat16", ...: config.json's dtype, else its torch_dtype
    head_dim: int | None = None                 # None: hidden_size // num_attention_heads (head_dim_of)
    attention_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None           # None where the family's use_sliding_window is off
    layer_types: list[str] | None = None        # per layer: full_attention or sliding_attention
    quantization_config: object = None
    num_experts: int = 0                        # 0: a dense model
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    query_pre_attn_scalar: float | None = None  # Gemma: attention scores scale by its -0.5 power, not head_dim's
    attn_logit_softcapping: float | None = None   # Gemma 2: scores become c * tanh(scores / c) before the softmax
    final_logit_softcapping: float | None = None  # Gemma: logits become c * tanh(logits / c)
    use_bidirectional_attention: bool | None = None  # Gemma: true attends both ways (an encoder); refused
    # gpt-oss's experts: (up + 1) * gate * sigmoid(swiglu_alpha * gate), gate clamped above at swiglu_limit and
    # up to [-swiglu_limit, swiglu_limit]; None for the families whose MLPs are plain SiLU-gated
    swiglu_alpha: float | None = None
    swiglu_limit: float | None = None
    # a classifier (architectures[0] *ForSequenceClassification): its head's outputs, len(id2label) as transformers
    # counts them (2 where config.json names none)
    num_labels: int = 2
    # vLLM's hf_overrides key: a causal LM scored as a classifier from these tokens' LM-head rows (Qwen3-Reranker's
    # ["no", "yes"]: one label, the probability of the second against the first)
    classifier_from_token: list[str] | None = None
    # DeepSeek's multi-head latent attention (models/deepseek.py); kv_lora_rank None: per-head keys and values
    kv_lora_rank: int | None = None       # the cached latent's width
    q_lora_rank: int | None = None        # None: queries projected from the hidden state directly (V2-Lite)
    qk_nope_head_dim: int | None = None   # each query and key head: these dimensions unrotated, then the rotary ones
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    rope_interleave: bool = False         # the rotary dimensions pair up as (0, 1), (2, 3), ... (DeepSeek V3)
    # DeepSeekMoE: dense MLPs in the first layers, shared experts beside the routed ones, group-limited routing
    first_k_dense_replace: int = 0
    n_shared_experts: int | None = None
    routed_scaling_factor: float = 1.0
    n_group: int | None = None
    topk_group: int | None = None
    topk_method: str | None = None        # DeepSeek V2's: greedy or group_limited_greedy
    num_nextn_predict_layers: int = 0     # DeepSeek V3's multi-token-prediction layers after the last one
    # an image-text checkpoint (Qwen2.5-VL, Qwen3-VL, Gemma 3): its vision tower's settings as config.json gives
    # them, and the ids of the tokens that hold an image's place in a prompt
    vision_config: dict | None = None
    image_token_id: int | None = None
    video_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None
    # Gemma 3: an image's placeholder in a prompt (<start_of_image>), the token closing its run of image tokens,
    # and the run's length
    boi_token_id: int | None = None
    eoi_token_id: int | None = None
    mm_tokens_per_image: int | None = None

    @property
    def is_classifier(self) -> bool:
        """It scores (its head classifies the last token) rather than generates."""
        return self.classifier_from_token is not None or (
            bool(self.architectures) and self.architectures[0].endswith(CLASSIFIER_SUFFIX))

    @property
    def num_classifier_outputs(self) -> int:
        """The classifier head's outputs: a two-token classifier is one label (the second token's logit less the
        first's), any other one per token; a classification checkpoint's num_labels."""
        tokens = self.classifier_from_token
        if tokens is not None:
            return 1 if len(tokens) == 2 else len(tokens)
        return self.num_labels


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# kind -> (whether a value is one, what the error says it must be)
_KINDS = {
    "count": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "count or null": (lambda v: v is None or _is_int(v) and v >= 1, "an integer >= 1 or null"),
    "int >= 0": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "int >= 0 or null": (lambda v: v is None or _is_int(v) and v >= 0, "an integer >= 0 or null"),
    "number": (lambda v: _is_number(v), "a number"),
    "number or null": (lambda v: v is None or _is_number(v), "a number or null"),
    "positive number or null": (lambda v: v is None or _is_number(v) and v > 0, "a number > 0 or null"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "bool or null": (lambda v: v is None or isinstance(v, bool), "true, false or null"),
    "text": (lambda v: isinstance(v, str), "a string"),
    "text or null": (lambda v: v is None or isinstance(v, str), "a string or null"),
    "texts or null": (lambda v: v is None or isinstance(v, list) and all(isinstance(s, str) for s in v),
                      "a list of strings or null"),
    "layer indices or null": (lambda v: v is None or isinstance(v, list) and all(_is_int(i) and i >= 0 for i in v),
                              "a list of integers >= 0 or null"),
    "token id or null": (lambda v: v is None or _is_int(v), "an integer or null"),
    "token ids or null": (lambda v: v is None or _is_int(v) or isinstance(v, list) and all(_is_int(i) for i in v),
                          "an integer, a list of integers or null"),
    "object": (lambda v: isinstance(v, dict), "an object"),
    "object or null": (lambda v: v is None or isinstance(v, dict), "an object or null"),
    "anything": (lambda v: True, ""),
}
FIELD_KINDS = {
    "model_type": "text", "vocab_size": "count", "hidden_size": "count", "intermediate_size": "count",
    "num_hidden_layers": "count", "num_attention_heads": "count",
    "num_key_value_heads": "count or null",  # null: num_attention_heads
    "max_position_embeddings": "count", "rms_norm_eps": "number", "tie_word_embeddings": "bool",
    "rope_parameters": "object", "hidden_act": "text or null", "hidden_activation": "text or null",
    "architectures": "texts or null",
    "bos_token_id": "token id or null", "eos_token_id": "token ids or null", "dtype": "text or null",
    "head_dim": "count or null", "attention_bias": "bool", "mlp_bias": "bool", "sliding_window": "count or null",
    "layer_types": "texts or null", "quantization_config": "anything", "num_experts": "int >= 0",
    "num_experts_per_tok": "count or null", "moe_intermediate_size": "count or null", "norm_topk_prob": "bool",
    "decoder_sparse_step": "count", "mlp_only_layers": "layer indices or null",  # null: none
    "query_pre_attn_scalar": "number or null", "attn_logit_softcapping": "positive number or null",
    "final_logit_softcapping": "positive number or null", "use_bidirectional_attention": "bool or null",
    "swiglu_alpha": "positive number or null", "swiglu_limit": "positive number or null",
    "num_labels": "count", "classifier_from_token": "texts or null",
    "kv_lora_rank": "count or null", "q_lora_rank": "count or null", "qk_nope_head_dim": "count or null",
    "qk_rope_head_dim": "count or null", "v_head_dim": "count or null", "rope_interleave": "bool",
    "first_k_dense_replace": "int >= 0", "n_shared_experts": "int >= 0 or null", "routed_scaling_factor": "number",
    "n_group": "count or null", "topk_group": "count or null", "topk_method": "text or null",
    "num_nextn_predict_layers": "int >= 0",
    "vision_config": "object or null", "image_token_id": "token id or null", "video_token_id": "token id or null",
    "vision_start_token_id": "token id or null", "vision_end_token_id": "token id or null",
    "boi_token_id": "token id or null", "eoi_token_id": "token id or null", "mm_tokens_per_image": "count or null",
}
# an image-text config's own keys beside its text_config
VISION_FIELDS = ("vision_config", "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
                 "boi_token_id", "eoi_token_id", "mm_tokens_per_image")
# keys read only to derive fields
SETTING_KINDS = {"use_sliding_window": "bool", "max_window_layers": "int >= 0", "sliding_window_pattern": "count",
                 "rope_local_base_freq": "number", "text_config": "object or null",
                 "original_max_position_embeddings": "count", "id2label": "object or null"}
assert list(FIELD_KINDS) == [f.name for f in fields(HFConfig)]


def _invalid(source: str, message: str) -> ValueError:
    return ValueError(f"{source} is not a valid model config: {message}")


def _checked(source: str, name: str, value, kind: str):
    is_kind, what = _KINDS[kind]
    if not is_kind(value):
        raise _invalid(source, f"{name} must be {what}, got {value!r:.80}")
    return value


def _rope_parameters(raw: dict, values: dict, family: Family, source: str) -> dict:
    """rope_parameters as transformers 5 standardizes them: transformers 4's rope_scaling wins when set, its
    top-level rope_theta and partial_rotary_factor fill in, llama3, yarn and longrope get the pre-training window
    (one set per layer type where config.json has them so); the family's own defaults where config.json says
    nothing."""
    if family.layer_type_thetas is not None:
        return _layer_type_rope_parameters(raw, values, family, source)
    given = raw.get("rope_scaling") or raw.get("rope_parameters")
    if given is not None and not isinstance(given, dict):
        raise _invalid(source, f"rope_parameters must be an object, got {given!r:.80}")
    params = dict(given or family.rope_parameters or {})
    if any(isinstance(value, dict) for value in params.values()):  # per layer type, as Gemma 3's
        return {layer_type: _standardized(dict(value), values, family, raw.get("rope_theta"))
                for layer_type, value in params.items()}
    return _standardized(params, values, family, raw.get("rope_theta", family.rope_theta))


def _standardized(params: dict, values: dict, family: Family, rope_theta) -> dict:
    """One set of rope parameters as transformers' standardize_rope_params completes it. A LongRoPE family's
    config class (Phi3Config) converts its own way: its top-level original_max_position_embeddings overrides
    the one in rope_parameters, and rope types su and yarn read as longrope."""
    params.setdefault("rope_theta", rope_theta)
    partial = values.get("partial_rotary_factor")
    if partial is not None or family.partial_rotary:  # such a family's config class holds it, even a null
        params.setdefault("partial_rotary_factor", partial)
    params.setdefault("rope_type", params.get("type", "default"))
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        if family.longrope:
            params["original_max_position_embeddings"] = values["original_max_position_embeddings"]
        else:
            params.setdefault("original_max_position_embeddings", values["max_position_embeddings"])
    if family.longrope and params["rope_type"] in ("su", "yarn"):
        params["rope_type"] = "longrope"
    return params


def _layer_type_rope_parameters(raw: dict, values: dict, family: Family, source: str) -> dict:
    """Rope parameters per layer type, as Gemma3TextConfig completes them: transformers 4's rope_scaling
    applies to the full-attention layers, its rope_theta and rope_local_base_freq give the full and sliding
    layers' thetas."""
    given = raw.get("rope_parameters")
    if given is not None and not (isinstance(given, dict) and all(isinstance(v, dict) for v in given.values())):
        raise _invalid(source, f"rope_parameters must be an object of one object per layer type, got {given!r:.80}")
    params = {layer_type: dict(value) for layer_type, value in (given or {}).items()}
    if _checked(source, "rope_scaling", raw.get("rope_scaling"), "object or null") is not None:
        params.setdefault("full_attention", {"rope_type": "default"}).update(raw["rope_scaling"])
    for layer_type, (key, theta) in family.layer_type_thetas.items():
        params.setdefault(layer_type, {"rope_type": "default"}).setdefault("rope_theta", raw.get(key, theta))
    return {layer_type: _standardized(value, values, family, None) for layer_type, value in params.items()}


def parse_hf_config(raw: dict, source: str) -> HFConfig:
    """HFConfig from a config.json's object; ValueError naming source and the field at fault."""
    if not isinstance(raw, dict):
        raise _invalid(source, f"it must be a JSON object, got {type(raw).__name__}")
    model_type = MODEL_TYPE_ALIASES.get(raw.get("model_type"), raw.get("model_type"))
    raw = {**raw, "model_type": model_type}
    if model_type not in FAMILIES:
        problem = "it has no model_type" if model_type is None else f"model_type {model_type!r:.80} is not supported"
        raise _invalid(source, f"{problem}; supported: {', '.join(FAMILIES)}")
    family = FAMILIES[model_type]
    if family.text_model_type is not None:
        return _text_part(raw, family, source)
    defaults = family.defaults
    values = {**defaults, **raw}
    for name, key in family.key_aliases.items():
        if key in raw:
            values[name] = raw[key]
    values["dtype"] = raw["dtype"] if raw.get("dtype") is not None else raw.get("torch_dtype")
    values.pop("rope_parameters", None)  # standardized from raw below
    for name, kind in {**FIELD_KINDS, **SETTING_KINDS}.items():
        if name in values:
            _checked(source, name, values[name], kind)
    heads, hidden_size = values["num_attention_heads"], values["hidden_size"]
    if family.requires_whole_heads and hidden_size % heads:  # LlamaConfig refuses it, whatever head_dim says
        raise _invalid(source, f"hidden_size={hidden_size} must be a multiple of num_attention_heads={heads}")
    # what each family's config class derives in its __post_init__
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = heads
    if "head_dim" in defaults and values["head_dim"] is None:
        values["head_dim"] = hidden_size // heads
    if family.latent_attention and raw.get("head_dim") is None:  # DeepseekV2Config and V3Config: the rotary part
        values["head_dim"] = values["qk_rope_head_dim"]
    if "use_sliding_window" in defaults and not values["use_sliding_window"]:
        values["sliding_window"] = None
    if "max_window_layers" in defaults and values["layer_types"] is None:
        values["layer_types"] = ["sliding_attention" if values.get("sliding_window") is not None
                                 and i >= values["max_window_layers"] else "full_attention"
                                 for i in range(values["num_hidden_layers"])]
    pattern = family.sliding_pattern
    if pattern is not None and values["layer_types"] is None:
        every = values[pattern] if isinstance(pattern, str) else pattern
        values["layer_types"] = ["sliding_attention" if (i + 1) % every else "full_attention"
                                 for i in range(values["num_hidden_layers"])]
    if values.get("layer_types") is not None:
        if len(values["layer_types"]) != values["num_hidden_layers"]:
            raise _invalid(source, f"layer_types has {len(values['layer_types'])} entries, not num_hidden_layers="
                                   f"{values['num_hidden_layers']}")
        values["layer_types"] = [LEGACY_LAYER_TYPES.get(t, t) for t in values["layer_types"]]
    if values.get("mlp_only_layers") is None:
        values["mlp_only_layers"] = []
    if raw.get("id2label"):  # transformers counts the labels it names; num_labels is only a fallback
        values["num_labels"] = len(raw["id2label"])
    values["rope_parameters"] = _rope_parameters(raw, values, family, source)
    return HFConfig(**{f.name: values[f.name] for f in fields(HFConfig) if f.name in values})


def _text_part(raw: dict, family: Family, source: str) -> HFConfig:
    """A multimodal config (Gemma3ForConditionalGeneration): its text_config (of family.text_model_type) serves
    the text model; the architecture, dtype, tied head and quantization are the outer config's, and its token
    ids where it has them (Gemma 3's list [1, 106] as EOS: end of text and end of turn)."""
    text = _checked(source, "text_config", raw.get("text_config"), "object or null") or {}
    config = parse_hf_config({**text, "model_type": family.text_model_type}, f"{source} (text_config)")
    outer = {**family.defaults, **raw}
    for name, key in family.key_aliases.items():
        if key in outer:
            outer[name] = outer[key]
    dtype = outer.get("dtype") if outer.get("dtype") is not None else outer.get("torch_dtype")
    own = {"architectures": outer.get("architectures"), "tie_word_embeddings": outer["tie_word_embeddings"],
           "dtype": dtype if dtype is not None else config.dtype,
           "quantization_config": outer.get("quantization_config", config.quantization_config),
           **{name: outer[name] for name in ("bos_token_id", "eos_token_id", "classifier_from_token",
                                              *(VISION_FIELDS if family.images else ())) if name in outer}}
    if outer.get("id2label"):  # a classifier's labels are the outer config's
        own["num_labels"] = len(outer["id2label"])
    for name, value in own.items():
        _checked(source, name, value, FIELD_KINDS[name])
    return replace(config, model_type=family.model_type, **own)


def _read_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path} is not a valid model config: {e}") from None


def load_hf_config(model: str | os.PathLike, overrides: dict | None = None) -> HFConfig:
    """The checkpoint folder's config.json (or a GGUF file's metadata), its keys replaced by overrides (vLLM's
    hf_overrides); ValueError naming the file and the field at fault, or the architecture or setting the shared
    decoder does not implement."""
    model = os.fspath(model)
    if overrides is not None and not isinstance(overrides, dict):
        raise ValueError(f"hf_overrides must be a dict of config.json keys, got {type(overrides).__name__}")
    if is_gguf(model):
        if overrides:
            raise ValueError("hf_overrides apply to a config.json; a GGUF file's settings come from its metadata")
        return _load_gguf_config(model)
    if not os.path.isdir(model):
        raise ValueError(f"model must be a local folder with config.json and safetensors weights, or a .gguf file, "
                         f"got {model!r}")
    config_file = os.path.join(model, "config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"model folder {model!r} has no config.json")
    raw = _read_json(config_file)
    if isinstance(raw, dict):  # a model we do not have is the first thing to tell
        raw = {**raw, **(overrides or {})}
        architecture_of(raw.get("architectures"))
    config = parse_hf_config(raw, config_file)
    check_supported(config)
    return config


def _load_gguf_config(model: str) -> HFConfig:
    """A GGUF file's metadata read as the config.json it stands for (tpengine/gguf/config.py), every tensor's shape
    checked against it."""
    from tpengine.gguf.config import check_shapes, hf_config_dict
    from tpengine.gguf.files import open_gguf
    checkpoint = open_gguf(model)
    raw = hf_config_dict(checkpoint)
    architecture_of(raw["architectures"])
    config = parse_hf_config(raw, model)
    check_supported(config)
    check_shapes(checkpoint, replace(config, head_dim=head_dim_of(config)))
    return config


def load_eos_token_ids(model: str, config: HFConfig) -> frozenset[int]:
    """End-of-sequence ids: generation_config.json's (all of them, where it lists several, as Llama 3's does),
    else config.json's."""
    generation_file = os.path.join(model, "generation_config.json")
    eos = None
    if os.path.isfile(generation_file):
        generation = _read_json(generation_file)
        if not isinstance(generation, dict):
            raise _invalid(generation_file, f"it must be a JSON object, got {type(generation).__name__}")
        eos = _checked(generation_file, "eos_token_id", generation.get("eos_token_id"), "token ids or null")
    if eos is None:
        eos = config.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


def architecture_of(architectures: list[str] | None) -> str:
    """The checkpoint's architecture; ValueError listing the supported ones when we have no model for it."""
    supported = ", ".join(ARCHITECTURES)
    if not architectures or not isinstance(architectures, list):
        raise ValueError(f"config.json names no architectures; supported: {supported}")
    if causal_architecture(architectures[0]) not in ARCHITECTURES:
        raise ValueError(f"architecture {architectures[0]!r} is not supported; supported: {supported} (and each "
                         f"one's {CLASSIFIER_SUFFIX})")
    return architectures[0]


# --- what the shared decoder makes of a config ------------------------------------------------------------


@dataclass(frozen=True)
class RopeParameters:
    """A checkpoint's rotary settings (rope_parameters_of); layers/rotary_embedding.py turns them into frequencies."""
    theta: float
    rope_type: str = "default"
    factor: float = 1.0                        # linear, llama3, yarn
    original_max_position: int | None = None   # llama3, yarn: the pre-training window
    low_freq_factor: float = 1.0               # llama3
    high_freq_factor: float = 4.0              # llama3
    beta_fast: float = 32.0                    # yarn
    beta_slow: float = 1.0                     # yarn
    attention_factor: float | None = None      # yarn: given, or derived from factor (and mscale)
    mscale: float | None = None                # yarn
    mscale_all_dim: float | None = None        # yarn
    truncate: bool = True                      # yarn: round the correction range outwards
    short_factor: tuple[float, ...] | None = None  # longrope: per frequency, within the pre-training window
    long_factor: tuple[float, ...] | None = None   # longrope: per frequency, past it
    partial_rotary_factor: float = 1.0         # the share of each head rotated (its first dimensions)

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope type {self.rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")


def head_dim_of(config: HFConfig) -> int:
    return config.head_dim or config.hidden_size // config.num_attention_heads


def kv_head_dim_of(config: HFConfig) -> int:
    """The width of one cached KV head: the head, or latent attention's one vector (latent and rotary key)."""
    if config.kv_lora_rank is not None:
        return config.kv_lora_rank + config.qk_rope_head_dim
    return head_dim_of(config)


def rotary_dim_of(head_dim: int, rope: RopeParameters) -> int:
    """The dimensions of each head the rotary embedding turns (the first ones), as transformers rounds them."""
    return int(head_dim * rope.partial_rotary_factor)


def family_of(config: HFConfig) -> Family:
    """The family whose rules the text model follows: a multimodal config's text_config's."""
    family = FAMILIES[config.model_type]
    return family if family.text_model_type is None else FAMILIES[family.text_model_type]


def rope_parameters_of(config: HFConfig, layer_idx: int | None = None) -> RopeParameters:
    """The rotary settings of layer layer_idx (Gemma 3 keeps one set per layer type), or of every layer where
    the checkpoint has one set; ValueError naming a rope type or setting we do not implement."""
    params = config.rope_parameters
    if any(isinstance(value, dict) for value in params.values()):
        assert layer_idx is not None, "rope parameters per layer type: ask for a layer's"
        layer_type = config.layer_types[layer_idx] if config.layer_types is not None else None
        if not isinstance(params.get(layer_type), dict):
            raise ValueError(f"rope_parameters has no parameters for layer {layer_idx}'s type {layer_type!r}")
        params = params[layer_type]
    rope_type = params.get("rope_type") or params.get("type") or "default"
    theta = params.get("rope_theta")
    if theta is None:
        raise ValueError("config has no rope_theta (neither at the top level nor in rope_parameters)")
    partial = params.get("partial_rotary_factor")
    partial = 1.0 if partial is None else partial
    if partial != 1 and not family_of(config).partial_rotary:
        raise ValueError(f"partial_rotary_factor={partial} is not supported for {config.model_type}; "
                         "rotary must cover the whole head")
    head_dim = head_dim_of(config)
    if not isinstance(partial, (int, float)) or not 0 < partial <= 1 or int(head_dim * partial) % 2:
        raise ValueError(f"partial_rotary_factor={partial!r} must be in (0, 1] and rotate an even number of each "
                         f"head's {head_dim} dimensions")
    common = dict(theta=float(theta), partial_rotary_factor=float(partial))
    if rope_type == "default":
        return RopeParameters(**common)
    if rope_type == "longrope":
        if not family_of(config).longrope:
            longrope_families = [family.model_type for family in FAMILIES.values() if family.longrope]
            raise ValueError(f"rope type 'longrope' is not supported for {config.model_type}; "
                             f"only for {', '.join(longrope_families)}")
        return _longrope_parameters(config, params, common, head_dim)
    original = params.get("original_max_position_embeddings") or config.max_position_embeddings
    factor = params.get("factor")
    if factor is None:
        raise ValueError(f"rope type {rope_type!r} needs a factor in rope_parameters")
    optional = {key: params[key] for key in ("low_freq_factor", "high_freq_factor", "attention_factor", "mscale",
                                             "mscale_all_dim", "truncate") if params.get(key) is not None}
    # transformers reads `beta_fast or 32`: a 0 or null takes the default too
    optional.update({key: float(params[key]) for key in ("beta_fast", "beta_slow") if params.get(key)})
    if rope_type == "llama3":
        missing = [key for key in ("low_freq_factor", "high_freq_factor") if key not in optional]
        if missing:
            raise ValueError(f"rope type 'llama3' needs {', '.join(missing)} in rope_parameters")
    return RopeParameters(rope_type=rope_type, factor=float(factor), original_max_position=int(original),
                          **common, **optional)


def _longrope_parameters(config: HFConfig, params: dict, common: dict, head_dim: int) -> RopeParameters:
    """LongRoPE (Phi-3 and later): a factor per frequency, short_factor within the pre-training window and
    long_factor past it, and cos/sin scaled by an attention factor derived from the window's extension."""
    missing = [key for key in ("short_factor", "long_factor", "original_max_position_embeddings")
               if params.get(key) is None]
    if missing:
        raise ValueError(f"rope type 'longrope' needs {', '.join(missing)} in rope_parameters")
    num_frequencies = int(head_dim * common["partial_rotary_factor"]) // 2
    lists = {}
    for key in ("short_factor", "long_factor"):
        value = params[key]
        if not (isinstance(value, list) and len(value) == num_frequencies
                and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value)):
            raise ValueError(f"rope_parameters' {key} must be a list of {num_frequencies} numbers (one per rotary "
                             f"frequency), got {value!r:.80}")
        lists[key] = tuple(float(x) for x in value)
    original = params["original_max_position_embeddings"]
    if not isinstance(original, int) or isinstance(original, bool) or original < 1:
        raise ValueError(f"original_max_position_embeddings must be an integer >= 1, got {original!r}")
    # transformers: without a factor, the ratio of the extended window to the pre-training one
    factor = params.get("factor")
    if factor is None:
        factor = config.max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeParameters(rope_type="longrope", factor=float(factor), original_max_position=original,
                          attention_factor=float(attention_factor), **lists, **common)


def mrope_section_of(config: HFConfig) -> tuple[int, ...] | None:
    """How an image model's M-RoPE splits each head's rotary frequencies between temporal, height and width
    positions (layers/mrope.py), as its config class reads it; None for a model that rotates by one position."""
    family = FAMILIES[config.model_type]
    if family.mrope_section is None:
        return None
    return tuple(config.rope_parameters.get("mrope_section") or family.mrope_section)


def long_rope_threshold_of(config: HFConfig) -> int | None:
    """LongRoPE's pre-training window: a sequence of more tokens is rotated with the long factors, one within it
    with the short ones (models/phi3.py); None for every other rope, whose rotation ignores the length."""
    ropes = {rope_parameters_of(config, i) for i in range(config.num_hidden_layers)}
    windows = {rope.original_max_position for rope in ropes if rope.rope_type == "longrope"}
    assert len(windows) <= 1, "one LongRoPE window per checkpoint"
    return windows.pop() if windows else None


def layer_sliding_window(config: HFConfig, layer_idx: int) -> int | None:
    """The attention window of one layer, or None where it attends to every earlier position."""
    if config.sliding_window is None:
        return None
    if config.layer_types is not None:  # Qwen2, Qwen3, Gemma: which layers slide is spelled out
        return config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None
    # Mistral and Qwen3-MoE slide in every layer whenever a window is set
    return config.sliding_window


def sliding_window_of(config: HFConfig) -> int | None:
    """The attention window of the checkpoint's sliding-window layers, or None when every layer attends fully."""
    windows = {layer_sliding_window(config, i) for i in range(config.num_hidden_layers)} - {None}
    assert len(windows) <= 1, "one window per checkpoint"
    return windows.pop() if windows else None


def every_layer_slides(config: HFConfig) -> bool:
    """Whether no layer reads a key older than the window: the ledger may then free the blocks behind it."""
    return all(layer_sliding_window(config, i) is not None for i in range(config.num_hidden_layers))


def max_positions_of(config: HFConfig) -> int:
    """The positions the model can encode: max_position_embeddings, or YaRN's extended window when longer
    (Qwen2.5 checkpoints keep the original 32k there and add yarn to reach factor x 32k)."""
    ropes = {rope_parameters_of(config, i) for i in range(config.num_hidden_layers)}
    return max([config.max_position_embeddings] + [int(rope.original_max_position * rope.factor)
                                                   for rope in ropes if rope.rope_type == "yarn"])


def max_model_len_of(config: HFConfig, requested: int) -> int:
    """The longest sequence the engine may run: the request, bounded by the positions the model encodes.
    A sliding window bounds nothing: its layers attend within it at any length."""
    return min(requested, max_positions_of(config))


def quantization_config_of(config: HFConfig):
    """The checkpoint's QuantizationConfig (tpengine/quantization/config.py), or None for a float checkpoint."""
    if not config.quantization_config:
        return None
    if not isinstance(config.quantization_config, dict):
        raise ValueError(f"quantization_config must be an object, got {config.quantization_config!r}")
    from tpengine.quantization.config import QuantizationConfig  # torch: only for a quantized checkpoint
    return QuantizationConfig.from_hf(config.quantization_config)


def check_supported(config: HFConfig) -> None:
    """ValueError naming the first setting of this checkpoint that the shared decoder does not implement."""
    family = family_of(config)
    key = family.activation_key  # None where the model ignores it (gpt-oss's experts)
    if key is not None and getattr(config, key) not in family.activations:
        raise ValueError(f"{key}={getattr(config, key)!r} is not supported; only {family.activations[0]!r} gated "
                         "MLPs are")
    # refused where the family's config class has the setting (Gemma's); the others' attention never reads it
    if config.use_bidirectional_attention and "use_bidirectional_attention" in family.defaults:
        raise ValueError("use_bidirectional_attention=True is not supported; only causal attention is")
    if config.quantization_config:  # a format or layout tpengine does not read is refused by name
        quantization_config_of(config)
    if config.classifier_from_token is not None and not config.classifier_from_token:
        raise ValueError("classifier_from_token is empty: it names the tokens whose LM-head rows classify")
    unknown = sorted(set(config.layer_types or ()) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported; supported: {', '.join(LAYER_TYPES)}")
    if config.num_experts and not 1 <= (config.num_experts_per_tok or 0) <= config.num_experts:
        raise ValueError(f"num_experts_per_tok={config.num_experts_per_tok} must be between 1 and "
                         f"num_experts={config.num_experts}")
    for layer_idx in range(config.num_hidden_layers):
        rope_parameters_of(config, layer_idx)
    if family.latent_attention:
        _check_latent_attention(config)


def _check_latent_attention(config: HFConfig) -> None:
    """DeepSeek's attention and routing settings, as its transformers classes need them."""
    missing = [name for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
               if getattr(config, name) is None]
    if missing:
        raise ValueError(f"{config.model_type} needs {', '.join(missing)}: multi-head latent attention has no "
                         "default for them")
    if config.head_dim != config.qk_rope_head_dim:  # transformers' rotary would turn head_dim dimensions
        raise ValueError(f"head_dim={config.head_dim} must equal qk_rope_head_dim={config.qk_rope_head_dim} (or be "
                         "left out): DeepSeek's rotary embedding turns head_dim dimensions of the rotary part")
    if not config.num_experts:
        return
    grouped = config.model_type == "deepseek_v3" or config.topk_method == "group_limited_greedy"
    if config.model_type == "deepseek_v2" and config.topk_method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"topk_method={config.topk_method!r} is not supported for deepseek_v2; supported: greedy, "
                         "group_limited_greedy")
    if grouped:
        groups, chosen = config.n_group, config.topk_group
        if groups is None or chosen is None or config.num_experts % groups or not chosen <= groups:
            raise ValueError(f"group-limited routing needs n_group dividing the {config.num_experts} routed experts "
                             f"and topk_group <= n_group, got n_group={groups}, topk_group={chosen}")
        if config.model_type == "deepseek_v3" and config.num_experts // groups < 2:
            raise ValueError(f"n_group={groups} leaves fewer than 2 experts per group; deepseek_v3 scores a group "
                             "by its top 2")
        if config.num_experts_per_tok > chosen * (config.num_experts // groups):
            raise ValueError(f"num_experts_per_tok={config.num_experts_per_tok} is more than the "
                             f"{chosen * (config.num_experts // groups)} experts of topk_group={chosen} groups")


def is_sparse_layer(config: HFConfig, layer_idx: int) -> bool:
    """Whether this layer's MLP is a mixture of experts (Qwen3-MoE's rule, which makes every layer of gpt-oss
    one); False for dense models."""
    return (config.num_experts > 0 and layer_idx not in config.mlp_only_layers
            and (layer_idx + 1) % config.decoder_sparse_step == 0 and layer_idx >= config.first_k_dense_replace)


def tensor_parallel_sizes(config: HFConfig) -> dict[str, int]:
    """The MLP sizes the tensor-parallel size must divide: each rank holds a slice of every one."""
    sparse = [is_sparse_layer(config, i) for i in range(config.num_hidden_layers)]
    sizes = {}
    if not all(sparse):
        sizes["intermediate_size"] = config.intermediate_size
    if any(sparse):
        sizes.update([expert_intermediate_size(config)])
        if config.n_shared_experts:  # DeepSeekMoE's shared experts: one gated MLP of their summed size
            sizes["n_shared_experts * moe_intermediate_size"] = config.n_shared_experts * config.moe_intermediate_size
    return sizes


def expert_intermediate_size(config: HFConfig) -> tuple[str, int]:
    """(the field, its value) giving each expert's intermediate size: Qwen3-MoE's moe_intermediate_size, or
    intermediate_size in gpt-oss, whose every MLP is experts."""
    if config.moe_intermediate_size is None:
        return "intermediate_size", config.intermediate_size
    return "moe_intermediate_size", config.moe_intermediate_size
