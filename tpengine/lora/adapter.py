"""Reading a PEFT LoRA adapter folder (adapter_config.json, adapter_model.safetensors or .bin) into plain tensors.

Only plain LoRA on the attention and MLP projections is read: y = W x + scale * B (A x). Every PEFT variant that
changes that sum (DoRA, LoRA biases, embedding or LM-head LoRA, fully trained module copies, ...) is refused
with a ValueError that names it, never half-applied. Nothing here imports peft.
"""
import json
import math
import os
import re
import struct

import msgspec

CONFIG_FILE = "adapter_config.json"
SAFETENSORS_FILE = "adapter_model.safetensors"
BIN_FILE = "adapter_model.bin"
# peft's state-dict keys name the module inside PeftModel.base_model.model; the base model's own path follows
KEY_PREFIX = "base_model.model."
# an image-text model's text layers (transformers 5's path, then 4's) are the decoder's model.layers here
TEXT_MODEL_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model."}
# the projections the LoRA layers take: Llama-style separate ones, and Phi-3's fused qkv_proj and gate_up_proj
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                     "qkv_proj", "gate_up_proj")
# LoraConfig fields that, set to anything truthy, change the math at inference or add weights we do not read
UNSUPPORTED_SETTINGS = {
    "use_dora": "DoRA (use_dora)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "lora_bias": "a bias on LoRA B (lora_bias)",
    "modules_to_save": "fully trained module copies (modules_to_save)",
    "trainable_token_indices": "trained token embeddings (trainable_token_indices)",
    "layer_replication": "replicated layers (layer_replication)",
    "target_parameters": "LoRA on bare parameters such as MoE experts (target_parameters)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "velora_config": "VeLoRA (velora_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "arrow_config": "Arrow routing (arrow_config)",
    "kasa_config": "KaSA (kasa_config)",
}
# init_lora_weights methods that also rewrite the base weights: such an adapter, saved unconverted, fits only
# the rewritten model (peft's converted save resets init_lora_weights to true)
BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


class AdapterConfig(msgspec.Struct, frozen=True):
    """What the layers need of an adapter: its largest rank (to size a slot), the projections its weights cover,
    and each module's scale. rank_pattern and alpha_pattern keep adapter_config.json's order: the first regex
    that matches a module wins, as in peft."""
    rank: int
    target_modules: tuple[str, ...]
    r: int  # the rank of a module no rank_pattern entry matches
    lora_alpha: float
    use_rslora: bool = False
    rank_pattern: tuple[tuple[str, int], ...] = ()
    alpha_pattern: tuple[tuple[str, float], ...] = ()

    def rank_of(self, module_path: str) -> int:
        return _pattern_value(self.rank_pattern, module_path, self.r)

    def alpha_of(self, module_path: str) -> float:
        return _pattern_value(self.alpha_pattern, module_path, self.lora_alpha)

    def scale_of(self, module_path: str) -> float:
        """lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA, each from the module's own pattern entry."""
        rank = self.rank_of(module_path)
        return self.alpha_of(module_path) / (math.sqrt(rank) if self.use_rslora else rank)


def _pattern_value(pattern: tuple[tuple[str, object], ...], module_path: str, default):
    # peft's get_pattern_key: a key matches the module path's tail, at a dot
    for key, value in pattern:
        if re.match(rf"(.*\.)?({key})$", module_path):
            return value
    return default


def adapter_files(path: str) -> str:
    """The weights file read_adapter_weights reads: adapter_model.safetensors, else adapter_model.bin."""
    for name in (SAFETENSORS_FILE, BIN_FILE):
        if os.path.isfile(os.path.join(path, name)):
            return os.path.join(path, name)
    raise ValueError(f"LoRA adapter {path}: has neither {SAFETENSORS_FILE} nor {BIN_FILE}")


def read_adapter_config(path: str, max_lora_rank: int) -> AdapterConfig:
    """adapter_config.json checked against what we serve, and the weights file's key names and shapes (a
    safetensors header, no tensor data) checked too: target_modules is what the weights cover, whatever
    regex or "all-linear" the config gave."""
    settings = _read_config_json(path)
    _check_settings(settings, path)
    config = _config_of(settings, path)
    _check_ranks(config, path, max_lora_rank)
    return msgspec.structs.replace(config, target_modules=_short_names(adapter_shapes(path, config)))


def adapter_shapes(path: str, config: AdapterConfig) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """{module_path: (A's shape, B's shape)}, every key checked, read without tensor data where the file allows:
    what a check against the base model's projections needs."""
    shapes = _weight_shapes(adapter_files(path))
    return {decoder_module(module): (shapes[a_key], shapes[b_key])
            for module, (a_key, b_key) in _lora_modules(shapes, config, path).items()}


def decoder_module(module: str) -> str:
    """An adapter's module path as the decoder's layers are named here: an image-text model's text layers
    (model.language_model.layers.N...) are model.layers.N...; peft's patterns still match the adapter's own path."""
    for prefix, ours in TEXT_MODEL_PREFIXES.items():
        if module.startswith(prefix):
            return ours + module.removeprefix(prefix)
    return module


def read_adapter_weights(path: str, config: AdapterConfig) -> dict[str, tuple["torch.Tensor", "torch.Tensor", float]]:
    """{module_path: (A [r, in_features], B [out_features, r], scale)}, float32 on the CPU; module_path as in the
    base model's state dict without ".weight" (e.g. "model.layers.0.self_attn.q_proj")."""
    import torch

    tensors = _load_tensors(adapter_files(path))
    modules = _lora_modules({key: tuple(t.shape) for key, t in tensors.items()}, config, path)
    if _short_names(modules) != config.target_modules:
        raise ValueError(f"LoRA adapter {path}: its weights cover {_short_names(modules)}, not the "
                         f"{config.target_modules} its config was read with (did the folder change?)")
    return {decoder_module(module): (tensors[a_key].to(torch.float32), tensors[b_key].to(torch.float32),
                                     config.scale_of(module))
            for module, (a_key, b_key) in modules.items()}


def _short_names(modules: dict[str, tuple[str, str]]) -> tuple[str, ...]:
    names = {module.rsplit(".", 1)[-1] for module in modules}
    return tuple(name for name in SUPPORTED_MODULES if name in names)


def _read_config_json(path: str) -> dict:
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter {path}: no such folder")
    config_file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_file):
        raise ValueError(f"LoRA adapter {path}: no {CONFIG_FILE} (a PEFT adapter folder has one)")
    try:
        with open(config_file) as f:
            settings = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"LoRA adapter {path}: {CONFIG_FILE} is not JSON ({e})") from None
    if not isinstance(settings, dict):
        raise ValueError(f"LoRA adapter {path}: {CONFIG_FILE} is not a JSON object")
    if settings.get("peft_type") != "LORA":
        raise ValueError(f"LoRA adapter {path}: peft_type is {settings.get('peft_type')!r}; only 'LORA' is served")
    return settings


def _check_settings(settings: dict, path: str) -> None:
    """Refuse what is clearly not plain LoRA on supported projections; lora_dropout does not act at inference."""
    for name, what in UNSUPPORTED_SETTINGS.items():
        if settings.get(name):
            raise ValueError(f"LoRA adapter {path}: {what} is not supported, got {name}={settings[name]!r}")
    if settings.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {path}: bias={settings['bias']!r} trains base biases; only 'none' "
                         "is supported")
    init = str(settings.get("init_lora_weights", True)).lower()
    if init.startswith(BASE_REWRITING_INITS):
        raise ValueError(f"LoRA adapter {path}: init_lora_weights={settings['init_lora_weights']!r} rewrites the "
                         "base weights, and this adapter was saved without converting back to plain LoRA")
    targets = settings.get("target_modules")
    if isinstance(targets, (list, tuple)):  # a regex string or "all-linear" is checked on the weights' keys
        for target in targets:
            if str(target).rsplit(".", 1)[-1] not in SUPPORTED_MODULES:
                raise ValueError(f"LoRA adapter {path}: target_modules names {target!r}; supported are "
                                 f"{', '.join(SUPPORTED_MODULES)}")


def _config_of(settings: dict, path: str) -> AdapterConfig:
    r = settings.get("r", 8)
    rank_pattern = tuple((settings.get("rank_pattern") or {}).items())
    alpha_pattern = tuple((settings.get("alpha_pattern") or {}).items())
    for name, rank in [("r", r)] + [(f"rank_pattern[{key!r}]", rank) for key, rank in rank_pattern]:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"LoRA adapter {path}: {name} must be an integer >= 1, got {rank!r}")
    for name, pattern in (("rank_pattern", rank_pattern), ("alpha_pattern", alpha_pattern)):
        for key, _ in pattern:
            try:
                re.compile(key)
            except re.error as e:
                raise ValueError(f"LoRA adapter {path}: {name} key {key!r} is not a regex ({e})") from None
    alpha = settings.get("lora_alpha", 8)
    for name, value in [("lora_alpha", alpha)] + [(f"alpha_pattern[{key!r}]", v) for key, v in alpha_pattern]:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"LoRA adapter {path}: {name} must be a number, got {value!r}")
    return AdapterConfig(rank=max([r] + [rank for _, rank in rank_pattern]), target_modules=(), r=r,
                         lora_alpha=float(alpha), use_rslora=bool(settings.get("use_rslora", False)),
                         rank_pattern=rank_pattern,
                         alpha_pattern=tuple((key, float(value)) for key, value in alpha_pattern))


def _check_ranks(config: AdapterConfig, path: str, max_lora_rank: int) -> None:
    if config.rank > max_lora_rank:
        where = "" if config.rank == config.r else " (in its rank_pattern)"
        raise ValueError(f"LoRA adapter {path}: adapter rank {config.rank}{where} is more than "
                         f"max_lora_rank={max_lora_rank}")


def _weight_shapes(weights_file: str) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape, without reading tensor data: a safetensors file's JSON header (8-byte little-endian
    length, then the JSON), or a .bin memory-mapped."""
    if weights_file.endswith(".bin"):
        return {key: tuple(t.shape) for key, t in _load_tensors(weights_file, mmap=True).items()}
    try:
        with open(weights_file, "rb") as f:
            (header_length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_length))
    except (struct.error, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{weights_file} is not a safetensors file ({e})") from None
    return {key: tuple(entry["shape"]) for key, entry in header.items() if key != "__metadata__"}


def _load_tensors(weights_file: str, mmap: bool = False) -> dict:
    import torch

    if weights_file.endswith(".safetensors"):
        from safetensors.torch import load_file
        return load_file(weights_file)
    try:  # weights_only: an adapter file is data, never code
        tensors = torch.load(weights_file, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # a legacy (pre-zip) file cannot be memory-mapped: read it whole
        if not mmap:
            raise ValueError(f"{weights_file} cannot be read as a torch state dict ({e})") from None
        return _load_tensors(weights_file)
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise ValueError(f"{weights_file} is not a state dict of tensors")
    return tensors


def _lora_modules(shapes: dict[str, tuple[int, ...]], config: AdapterConfig, path: str) -> dict[str, tuple[str, str]]:
    """{module_path: (A's key, B's key)}, every key accounted for and every shape agreeing with the module's rank."""
    halves: dict[str, dict[str, str]] = {}
    for key in sorted(shapes):  # the first problem named is the same whatever order the file keeps
        module, half = _parse_key(key, path)
        halves.setdefault(module, {})[half] = key
    for module, pair in halves.items():
        for half, other in (("A", "B"), ("B", "A")):
            if half not in pair:
                raise ValueError(f"LoRA adapter {path}: {pair[other]} has no lora_{half} to go with it")
        _check_shapes(module, shapes[pair["A"]], shapes[pair["B"]], config.rank_of(module), path)
    if not halves:
        raise ValueError(f"LoRA adapter {path}: its weights file holds no LoRA weights")
    return {module: (pair["A"], pair["B"]) for module, pair in sorted(halves.items())}


def _parse_key(key: str, path: str) -> tuple[str, str]:
    """'base_model.model.<module>.lora_A.weight' -> (module, 'A'); anything else is refused by name."""
    refused = {"lora_embedding_": "LoRA on an embedding", "lora_magnitude_vector": "DoRA's magnitude vector",
               ".lora_B.bias": "a bias on LoRA B (lora_bias)",
               ".base_layer.": "a copy of a base weight (peft saves one when it adapts embed_tokens or lm_head)"}
    for marker, what in refused.items():
        if marker in key:
            raise ValueError(f"LoRA adapter {path}: {key} is {what}, which is not supported")
    match = re.fullmatch(r"(.+)\.lora_([AB])\.weight", key)
    if not key.startswith(KEY_PREFIX) or match is None:
        raise ValueError(f"LoRA adapter {path}: {key} is not a PEFT LoRA A or B weight "
                         f"('{KEY_PREFIX}<module>.lora_A.weight')")
    module = match.group(1)[len(KEY_PREFIX):]
    if module.rsplit(".", 1)[-1] not in SUPPORTED_MODULES:
        raise ValueError(f"LoRA adapter {path}: {key} adapts {module}; supported are {', '.join(SUPPORTED_MODULES)}")
    return module, match.group(2)


def _check_shapes(module: str, a_shape: tuple[int, ...], b_shape: tuple[int, ...], rank: int, path: str) -> None:
    if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != rank or b_shape[1] != rank:
        raise ValueError(f"LoRA adapter {path}: {module}'s lora_A {list(a_shape)} and lora_B {list(b_shape)} "
                         f"disagree with its rank {rank} (A is [r, in_features], B is [out_features, r])")
