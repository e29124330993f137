"""transformers reading a GGUF file, as `from_pretrained(dir, gguf_file=...)` does (its config from the metadata,
every tensor dequantized by gguf.quants.dequantize and unpermuted by transformers' own processor), in float32.
from_pretrained itself wants accelerate for GGUF; these are the steps it takes."""
import functools
import os

import torch


@functools.lru_cache(maxsize=None)
def transformers_from_gguf(path: str, config_folder: str | None = None):
    """config_folder: the folder whose config.json serves instead of the file's metadata, where transformers
    cannot read the config from it: llama 3's rope scaling (it drops rope_freqs), Gemma's query_pre_attn_scalar."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    config = AutoConfig.from_pretrained(config_folder) if config_folder else \
        AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    model.generation_config.eos_token_id = None  # compare full lengths; our side runs with ignore_eos
    return model.eval()


def transformers_greedy(path: str, prompts: list[list[int]], max_new_tokens: int,
                        dequantized_into: str | None = None, config_folder: str | None = None) -> list[list[int]]:
    """dequantized_into: the folder whose model takes the file's dequantized tensors (transformers_from_dequantized)
    instead of transformers' own reading of the file; config_folder: see transformers_from_gguf."""
    model = transformers_from_dequantized(path, dequantized_into) if dequantized_into else \
        transformers_from_gguf(path, config_folder)
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


@functools.lru_cache(maxsize=None)
def transformers_from_dequantized(path: str, folder: str):
    """The model of folder in transformers, float32, its weights replaced by gguf.quants.dequantize of the file's
    tensors (each expert of a stacked tensor its own): the oracle where transformers' own GGUF reading fails (its
    qwen3moe processor drops the stacked experts)."""
    from gguf import GGUFReader, dequantize
    from transformers import AutoModelForCausalLM
    from tpengine.gguf.config import gguf_architecture
    from tpengine.gguf.tensors import _EXPERTS, hf_name, layer_names
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    reader = GGUFReader(path)
    metadata = {"general.architecture": bytes(reader.fields["general.architecture"].parts[-1]).decode()}
    layers = layer_names(gguf_architecture(metadata, path)[1])
    tensors = {}
    for tensor in reader.tensors:
        weights = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy())
        layer, stem = tensor.name.split(".")[1:3] if tensor.name.startswith("blk.") else (None, None)
        if stem in _EXPERTS:
            suffix = tensor.name.rsplit(".", 1)[1]
            tensors.update((f"model.layers.{layer}.mlp.experts.{e}.{_EXPERTS[stem]}.{suffix}", w)
                           for e, w in enumerate(weights))
        else:
            tensors[hf_name(tensor.name, layers).removesuffix(".sinks.weight").replace(
                ".self_attn", ".self_attn.sinks") if ".attn_sinks." in tensor.name else hf_name(tensor.name, layers)] = \
                weights
    missing, unexpected = model.load_state_dict(_as_model_keys(model, tensors), strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.generation_config.eos_token_id = None
    return model.eval()


def _as_model_keys(model, tensors: dict) -> dict:
    """Per-expert checkpoint tensors stacked as transformers 5 holds them (experts.gate_up_proj, experts.down_proj;
    gpt-oss's [experts, in, out] with gate and up interleaved, and its biases)."""
    if any(key.endswith("experts.gate_up_proj_bias") for key in model.state_dict()):
        return _as_gpt_oss_keys(tensors)
    if any(key.endswith("experts.gate_up_proj") for key in model.state_dict()):
        layers = {key.split(".")[2] for key in tensors if ".experts." in key}
        for layer in layers:
            prefix = f"model.layers.{layer}.mlp.experts"
            count = sum(1 for key in tensors if key.startswith(prefix) and key.endswith("down_proj.weight"))
            gate_up = [[tensors.pop(f"{prefix}.{e}.{projection}_proj.weight") for projection in ("gate", "up")]
                       for e in range(count)]
            tensors[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat(pair) for pair in gate_up])
            tensors[f"{prefix}.down_proj"] = torch.stack([tensors.pop(f"{prefix}.{e}.down_proj.weight")
                                                          for e in range(count)])
    return tensors


def _as_gpt_oss_keys(tensors: dict) -> dict:
    for layer in {key.split(".")[2] for key in tensors if ".experts." in key}:
        prefix = f"model.layers.{layer}.mlp.experts"
        count = sum(1 for key in tensors if key.startswith(prefix) and key.endswith("down_proj.weight"))
        take = lambda name, kind: torch.stack([tensors.pop(f"{prefix}.{e}.{name}_proj.{kind}")  # noqa: E731
                                               for e in range(count)])
        for kind, suffix in (("weight", ""), ("bias", "_bias")):
            gate, up = take("gate", kind), take("up", kind)
            if kind == "weight":  # [experts, out, in] -> [experts, in, out]
                gate, up = gate.transpose(1, 2), up.transpose(1, 2)
            tensors[f"{prefix}.gate_up_proj{suffix}"] = torch.stack([gate, up], dim=-1).flatten(-2)  # interleaved
            down = take("down", kind)
            tensors[f"{prefix}.down_proj{suffix}"] = down.transpose(1, 2) if kind == "weight" else down
    return tensors
