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
    packed = getattr(model, "packed_modules_mapping", {})
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = set()
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                target, shard_id = name, None
                for ckpt_name, (packed_name, packed_shard) in packed.items():
                    if f".{ckpt_name}." in name:
                        target, shard_id = name.replace(ckpt_name, packed_name), packed_shard
                        break
                if target not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in the model")
                param = params[target]
                loader = getattr(param, "weight_loader", default_weight_loader)
                tensor = f.get_tensor(name)
                loader(param, tensor) if shard_id is None else loader(param, tensor, shard_id)
                loaded.add(target)
    # With tied embeddings the checkpoint may carry only one of the two names.
    missing = {n for n, p in params.items() if n not in loaded
               and not any(p is params[m] for m in loaded)}
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks weights for: {sorted(missing)[:5]}")
