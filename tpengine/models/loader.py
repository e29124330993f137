"""Load HF safetensors (one file or sharded) through each parameter's own weight_loader.

A checkpoint that cannot fill the model (a file cut short, a tensor missing or of the wrong shape)
is a ValueError naming the file or tensor, raised alike on every rank.
"""
import json
import os
from glob import glob

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from tpengine.layers.linear import check_weight_shape


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


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    check_weight_shape(loaded_weight, param.shape)
    param.data.copy_(loaded_weight)


def _open(file: str):
    try:
        return safe_open(file, framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:  # cut short, not safetensors at all, or missing
        raise ValueError(f"{file} is not a readable safetensors file: {e}") from None


def load_model(model: nn.Module, path: str | os.PathLike) -> None:
    path = os.fspath(path)
    params = dict(model.named_parameters(remove_duplicate=False))
    # a tied parameter's first name (the embedding) wins when the checkpoint carries it under both, as in transformers
    canonical = {id(param): name for name, param in model.named_parameters()}
    chosen = {}  # (parameter, loader arguments) -> (file, checkpoint name): each loads once
    for file in checkpoint_files(path):
        with _open(file) as f:
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq"):  # older checkpoints save the rope buffer: recomputed here
                    continue
                target, args = model.checkpoint_target(name)
                if target not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in the model")
                key = (id(params[target]), args)
                if key not in chosen or target == canonical[key[0]]:
                    chosen[key] = (file, name, target, args)
    for file in sorted({entry[0] for entry in chosen.values()}):
        with _open(file) as f:
            for _, name, target, args in (entry for entry in chosen.values() if entry[0] == file):
                param = params[target]
                try:
                    getattr(param, "weight_loader", default_weight_loader)(param, f.get_tensor(name), *args)
                except (ValueError, RuntimeError, IndexError, SafetensorError) as e:
                    raise ValueError(f"checkpoint tensor {name!r} in {file} cannot be loaded: {e}") from None
    loaded: dict[int, set[tuple]] = {}
    for param_id, args in chosen:
        loaded.setdefault(param_id, set()).add(args)
    missing = []
    for name, param in model.named_parameters():  # a tied parameter once, under its first name
        # a packed parameter (q/k/v, gate/up, stacked experts) needs every one of its parts
        lacking = [args for args in getattr(param, "loader_shards", [()]) if args not in loaded.get(id(param), ())]
        if lacking:
            missing.append(name if lacking == [()] else f"{name} (its parts {lacking[:4]})")
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks weights for: {missing[:5]}")
