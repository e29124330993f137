"""Load HF safetensors (one file or sharded) through each parameter's own weight_loader."""
import json
import os
from glob import glob

import torch
from safetensors import safe_open
from torch import nn


def checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return sorted({os.path.join(path, name) for name in json.load(f)["weight_map"].values()})
    files = sorted(glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors weights found in {path!r}")
    return files


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    param.data.copy_(loaded_weight)


def load_model(model: nn.Module, path: str) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    # a tied parameter's first name (the embedding) wins when the checkpoint carries it under both, as in transformers
    canonical = {id(param): name for name, param in model.named_parameters()}
    chosen = {}  # (parameter, loader arguments) -> (file, checkpoint name): each loads once
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
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
        with safe_open(file, framework="pt", device="cpu") as f:
            for _, name, target, args in (entry for entry in chosen.values() if entry[0] == file):
                param = params[target]
                getattr(param, "weight_loader", default_weight_loader)(param, f.get_tensor(name), *args)
    loaded = {key[0] for key in chosen}
    missing = {n for n, p in params.items() if id(p) not in loaded}
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks weights for: {sorted(missing)[:5]}")
