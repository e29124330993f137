"""Load HF safetensors (one file or sharded) through each parameter's own weight_loader (its LoadState's).

A quantized checkpoint's linear is several tensors (GPTQ's qweight, qzeros, scales, g_idx, say): they are
read together into one QuantizedWeight (tpengine/quantization) and handed to the weight_loader of the
linear's weight; an FP8 linear is read as an Fp8Weight where the platform multiplies FP8 (keep_fp8) and the
parameter takes one, else as its float weight. A float checkpoint quantized at load
(`quantization="int8" | "int4" | "fp8"`) hands over each
linear's weight quantized whole, before any rank takes its shard, so every tensor-parallel size computes
with the same scales.

A checkpoint that cannot fill the model (a file cut short, a tensor missing or of the wrong shape), a scale
that is NaN or Inf, or a linear stored float where the checkpoint's quantization_config quantizes it, is a
ValueError naming the file or tensor, raised alike on every rank.

load_and_prepack is what a rank does with its freshly built shard: load it (quantizing as the checkpoint or the
engine says), then prepack each layer's weights for the platform.
"""
import json
import logging
import os
from contextlib import ExitStack
from dataclasses import dataclass
from glob import glob

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from tpengine.config import FP8_NEEDS_A_GPU, EngineConfig
from tpengine.gguf import is_gguf
from tpengine.hf_config import quantization_config_of
from tpengine.layers.attention import kv_scale_target
from tpengine.layers.linear import FUSED
from tpengine.layers.load_state import keep_weights_in, load_state
from tpengine.quantization.fp8 import Fp8Weight
from tpengine.quantization.weights import QuantizedWeight, check_finite_scales

logger = logging.getLogger("tpengine")


@dataclass(frozen=True)
class OnlineQuantization:
    """A float checkpoint's linears quantized as they load, symmetric: int8 per output channel or int4 in
    groups of group_size input features; or FP8 (e4m3 per output channel, inputs per token), the linears only."""
    bits: int
    group_size: int | None  # None: one group per output channel
    activation: str  # "float", or "int8" ("fp8" with fp8): inputs quantized per token as they arrive
    lm_head: bool  # the LM head and embedding too (they are one tensor when tied)
    fp8: bool = False  # e4m3 weights (bits 8, group_size None), for a platform with FP8 matmuls

    def applies_to(self, target: str, param: nn.Parameter) -> bool:
        if not load_state(param).takes_form(Fp8Weight if self.fp8 else QuantizedWeight) or target.endswith(".bias"):
            return False
        if _is_moe_router(target) or target.startswith("score."):  # a classifier head's outputs are the scores
            return False
        return self.lm_head or not _is_head_or_embedding(target)

    def quantize(self, weight: torch.Tensor):
        if self.fp8:
            from tpengine.quantization.fp8 import quantize_fp8_weight
            return quantize_fp8_weight(weight)
        from tpengine.quantization.online import quantize_weight
        return quantize_weight(weight.float(), self.bits, self.group_size, self.activation)


def online_quantization(config: EngineConfig, platform, device: torch.device) -> OnlineQuantization | None:
    """How a float checkpoint's linears are quantized as they load, if the engine is told to."""
    if config.quantization is None:
        return None
    if config.quantization == "fp8":
        if not platform.runs_fp8_linears(device):
            raise ValueError(FP8_NEEDS_A_GPU.format(where=f"this {device.type} device"))
        return OnlineQuantization(8, None, "fp8", lm_head=False, fp8=True)  # inputs: e4m3 per token
    activation = platform.ONLINE_QUANTIZATION_ACTIVATION
    bits = 8 if config.quantization == "int8" else 4
    return OnlineQuantization(bits, None if bits == 8 else config.quantization_group_size, activation,
                              lm_head=config.quantize_lm_head)


def _is_moe_router(target: str) -> bool:
    # tiny, and its top-k choice is sensitive: quantizers leave it float unless told
    return ".mlp.gate." in target or ".mlp.router." in target


def _is_head_or_embedding(target: str) -> bool:
    return target.startswith("lm_head.") or "embed_tokens." in target


def checkpoint_files(path: str | os.PathLike) -> list[str]:
    path = os.fspath(path)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                return sorted({os.path.join(path, name) for name in json.load(f)["weight_map"].values()})
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index} is not a valid safetensors index: {e!r}") from None
    files = sorted(glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors weights found in {path!r}")
    return files


def _open(file: str):
    try:
        return safe_open(file, framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:  # cut short, not safetensors at all, or missing
        raise ValueError(f"{file} is not a readable safetensors file: {e}") from None


def _quantized_modules(quantization, files_of: dict[str, str]) -> dict[str, dict[str, str]]:
    """module name -> {tensor suffix: checkpoint name} for every linear the checkpoint stores quantized."""
    modules: dict[str, dict[str, str]] = {}
    for name in files_of:
        module, suffix = quantization.split_name(name)
        if suffix in quantization.tensor_suffixes:
            modules.setdefault(module, {})[suffix] = name
    return {module: tensors for module, tensors in modules.items()
            if not quantization.skips(module) and quantization.is_quantized(module, set(tensors))}


def _check_not_left_float(quantization, name: str, target: str, param: nn.Parameter) -> None:
    """A linear's or expert's float weight where the quantization_config quantizes its module is a ValueError naming
    the quantized tensor the checkpoint lacks (a float checkpoint under a quantized one's config, say). The router,
    LM head and embedding are left alone: the tools leave them float unless told, and the config may not say."""
    module, _ = quantization.split_name(name)
    if name != quantization.weight_name(module) or param.dim() < 2 or _is_moe_router(target) \
            or _is_head_or_embedding(target):
        return  # not a weight the quantization tools quantize by default
    expected = quantization.quantized_tensor(module)
    if expected is not None:
        raise ValueError(f"checkpoint tensor {name!r} is float, but its {quantization.method} quantization_config "
                         f"quantizes {module!r}: the checkpoint lacks {expected!r}")


def _served(model: nn.Module, name: str) -> bool:
    """Whether the model reads this checkpoint tensor (not one of a vision tower it does not serve)."""
    return model.checkpoint_target(name)[0] is not None


def _load(param: nn.Parameter, loaded, args: tuple, what: str) -> None:
    try:
        load_state(param).weight_loader(param, loaded, *args)
    except (ValueError, RuntimeError, IndexError, SafetensorError) as e:
        raise ValueError(f"{what} cannot be loaded: {e}") from None


def _load_quantized(model: nn.Module, params: dict, quantization, module: str,
                    tensors: dict[str, torch.Tensor], keep_fp8: bool) -> tuple[int, tuple]:
    """One quantized linear read from its tensors into its weight's loader; its (parameter, arguments) key. A
    format read into floats (FP8 on the CPU, MXFP4) loads into any parameter, as a float checkpoint's would."""
    target, args = model.checkpoint_target(quantization.weight_name(module))
    if target not in params:
        raise ValueError(f"quantized checkpoint module {module!r} has no matching linear in the model")
    param = params[target]
    state = load_state(param)
    try:
        weight = quantization.read_linear(module, tensors, keep_fp8=keep_fp8 and state.takes_form(Fp8Weight))
    except (ValueError, RuntimeError, IndexError) as e:
        raise ValueError(f"quantized checkpoint module {module!r} cannot be read: {e}") from None
    if not state.takes_form(type(weight)):
        raise ValueError(f"checkpoint module {module!r} is quantized, but {target} cannot run quantized")
    _load(param, weight, args, f"quantized checkpoint module {module!r}")
    return id(param), args


def _load_gguf(model: nn.Module, params: dict, path: str, online: OnlineQuantization | None,
               activation: str = "float") -> dict:
    """A GGUF checkpoint's tensors, each in its own type (tpengine/gguf/tensors.py), into the model's weight
    loaders; the (parameter id, loader arguments) each filled. A block-quantized tensor loads only where its layer
    runs quantized weights."""
    from tpengine.gguf.files import open_gguf
    from tpengine.gguf.tensors import checkpoint_tensors
    chosen = {}
    for gguf_name, name, read in checkpoint_tensors(open_gguf(path), activation):
        target, args = model.checkpoint_target(name)
        if target is None:
            continue
        if target not in params:
            raise ValueError(f"GGUF tensor {gguf_name!r} ({name}) has no matching parameter in the model")
        param, what = params[target], f"GGUF tensor {gguf_name!r} in {path}"
        loaded = read()
        if isinstance(loaded, QuantizedWeight) and not load_state(param).takes_form(QuantizedWeight):
            raise ValueError(f"{what} is block-quantized, but {target} runs float weights only")
        if online is not None and isinstance(loaded, torch.Tensor) and loaded.dim() == 2 \
                and online.applies_to(target, param):
            loaded = online.quantize(loaded)
        _load(param, loaded, args, what)
        chosen[(id(param), args)] = gguf_name
    return chosen


def _bare_model_prefix(names) -> str:
    """"model." for a checkpoint saved from the decoder without its LM head (an embedding model such as
    Qwen3-Embedding: "layers.0...." where the causal LM has "model.layers.0...."), else ""."""
    return "model." if "embed_tokens.weight" in names and not any(n.startswith("model.") for n in names) else ""


def load_model(model: nn.Module, path: str | os.PathLike, quantization=None,
               online: OnlineQuantization | None = None, keep_fp8: bool = False, gguf_activation: str = "float") -> None:
    """quantization: the checkpoint's QuantizationConfig (tpengine/quantization/config.py), if it has one;
    keep_fp8: the platform multiplies FP8, so an FP8 checkpoint's linears load as Fp8Weight; gguf_activation: how a
    GGUF file's block-quantized linears take their input ("float" or "int8")."""
    path = os.fspath(path)
    params = dict(model.named_parameters(remove_duplicate=False))
    if is_gguf(path):
        return _check_filled(model, path, _load_gguf(model, params, path, online, gguf_activation))
    # a tied parameter's first name (the embedding) wins when the checkpoint carries it under both, as in transformers
    canonical = {id(param): name for name, param in model.named_parameters()}
    files_of = {}
    for file in checkpoint_files(path):
        with _open(file) as f:
            files_of.update((name, file) for name in f.keys())
    files_of = {name: file for name, file in files_of.items() if _served(model, name)}
    prefix = _bare_model_prefix(files_of)
    quantized = _quantized_modules(quantization, files_of) if quantization is not None else {}
    in_quantized = {name for tensors in quantized.values() for name in tensors.values()}
    chosen = {}  # (parameter, loader arguments) -> (file, checkpoint name): each loads once
    for name, file in files_of.items():
        if name.endswith("rotary_emb.inv_freq") or name in in_quantized:  # older checkpoints save the rope buffer
            continue
        target, args = model.checkpoint_target(prefix + name)
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in the model")
        if quantization is not None:
            _check_not_left_float(quantization, name, target, params[target])
        key = (id(params[target]), args)
        if key not in chosen or target == canonical[key[0]]:
            chosen[key] = (file, name, target, args)
    for file in sorted({entry[0] for entry in chosen.values()}):
        with _open(file) as f:
            for _, name, target, args in (entry for entry in chosen.values() if entry[0] == file):
                param, tensor = params[target], f.get_tensor(name)
                if kv_scale_target(name) is not None:
                    check_finite_scales(name, tensor)
                if online is not None and tensor.dim() == 2 and online.applies_to(target, param):
                    tensor = online.quantize(tensor)
                _load(param, tensor, args, f"checkpoint tensor {name!r} in {file}")
    with ExitStack() as stack:
        handles = {}  # file -> its open handle: a module's tensors are read together, from wherever they are
        for module, tensors in quantized.items():
            read = {}
            for suffix, name in tensors.items():
                file = files_of[name]
                if file not in handles:
                    handles[file] = stack.enter_context(_open(file))
                read[suffix] = handles[file].get_tensor(name)
            chosen[_load_quantized(model, params, quantization, module, read, keep_fp8)] = (files_of[name], module)
    _check_filled(model, path, chosen)


def _check_filled(model: nn.Module, path: str, chosen: dict) -> None:
    """ValueError naming the parameters no checkpoint tensor filled; chosen: (parameter id, loader arguments) keys."""
    loaded: dict[int, set[tuple]] = {}
    for param_id, args in chosen:
        loaded.setdefault(param_id, set()).add(args)
    missing = []
    for name, param in model.named_parameters():  # a tied parameter once, under its first name
        # a packed parameter (q/k/v, gate/up, stacked experts) needs every one of its parts, or one fused tensor
        got = loaded.get(id(param), set())
        lacking = [] if (FUSED,) in got else [args for args in load_state(param).shards if args not in got]
        if lacking:
            missing.append(name if lacking == [()] else f"{name} (its parts {lacking[:4]})")
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks weights for: {missing[:5]}")


def load_and_prepack(model: nn.Module, path: str, hf_config, config: EngineConfig, platform, device: torch.device,
                     weight_dtype: torch.dtype | None, log: bool = False) -> None:
    """A rank's model shard (the model, or a draft model) filled from its checkpoint, quantized as the engine is
    told (a float checkpoint) or as its config says, and prepacked for platform (platforms/); weight_dtype: the
    linears' weights kept in it (None: the model's dtype); log: say how it was quantized."""
    quantization = quantization_config_of(hf_config)
    online = None if quantization is not None else online_quantization(config, platform, device)
    keep_fp8 = platform.runs_fp8_linears(device)
    if weight_dtype is not None:
        keep_weights_in(model, weight_dtype)
    gguf_activation = "float" if config.gguf_activations == "float" else platform.ONLINE_QUANTIZATION_ACTIVATION
    load_model(model, path, quantization, online, keep_fp8, gguf_activation)
    if getattr(hf_config, "classifier_from_token", None) is not None:  # from the head's rows, before prepack
        from tpengine.pooling import classifier_token_ids
        model.classify_from_tokens(classifier_token_ids(config.tokenizer or path, hf_config.classifier_from_token))
    if log and quantization is not None:
        fp8 = ("FP8 W8A8 linears" if keep_fp8 else "FP8 weights converted to float at load: no FP8 matmul here")
        logger.info("%s: quantized checkpoint: %s%s", path, quantization.describe(),
                    f" ({fp8})" if "e4m3" in quantization.describe() else "")
    elif log and online is not None:
        logger.info("%s: weights quantized at load: %s, inputs %s", path, config.quantization, online.activation)
    for module in model.modules():  # the linears' weights in the form their platform multiplies fastest
        if hasattr(module, "prepack"):
            module.prepack(weight_dtype)
    platform.release_freed_memory()
