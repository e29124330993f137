"""Quantized checkpoints written from a tiny float one, as the quantization tools publish them, with the
float reference checkpoint transformers runs as the oracle.

    written = write_quantized_checkpoint(float_dir, quantized_dir, CheckpointFormat("gptq", bits=4, ...))
    write_reference_checkpoint(float_dir, reference_dir, written)

Every linear of the decoder layers (q/k/v/o, gate/up/down, MoE experts' and shared experts' gate/up/down)
is quantized round-to-nearest; embeddings, norms, MoE routers and lm_head stay float, as the tools leave
them by default. The quantized checkpoint has the producing library's tensor names and layout and a
config.json with a realistic `quantization_config`; compressed-tensors tensors are packed with the
compressed-tensors library's own pack_to_int32. `written` maps each quantized module to the
QuantizedWeight that was packed (for FP8, the float32 weight it stands for); the reference checkpoint is the
float model with those linears replaced by their dequantize(), all float32, without quantization_config.
Both are deterministic in CheckpointFormat.seed.
"""
import glob
import json
import os
import re
import shutil
import zlib
from dataclasses import dataclass

import torch
from safetensors.torch import load_file, save_file

from tpengine.quantization.weights import QuantizedWeight

QUANTIZED_LINEAR = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.([qkvo]|qkv)_proj"  # qkv_proj, gate_up_proj: Phi-3's fused ones
    r"|mlp\.(experts\.\d+\.|shared_expert\.)?(gate|up|down|gate_up)_proj)$")
FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "gptq", "awq")
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


@dataclass(frozen=True)
class CheckpointFormat:
    method: str  # one of FORMATS: a compressed-tensors format, "gptq" or "awq"
    bits: int | None = None  # pack-quantized and gptq: 4 (default) or 8; int-quantized, float-quantized: 8; awq: 4
    group_size: int | None = 128  # None: one group per output channel (GPTQ's -1, compressed-tensors' channel)
    sym: bool | None = None  # symmetric (default), or with zero points; awq always has zero points
    desc_act: bool = False  # act order: g_idx (GPTQ) or weight_g_idx (pack-quantized) from a column permutation
    checkpoint_format: str = "gptq"  # GPTQ: "gptq" stores zero points less 1, "gptq_v2" as they are
    fp8_strategy: str = "channel"  # float-quantized: "channel" or "tensor"
    seed: int = 0

    def __post_init__(self):
        if self.method not in FORMATS:
            raise ValueError(f"unknown checkpoint format {self.method!r}; use one of {FORMATS}")
        if self.bits is None:
            object.__setattr__(self, "bits", 8 if self.method in ("int-quantized", "float-quantized") else 4)
        if self.sym is None:
            object.__setattr__(self, "sym", self.method != "awq")
        if self.method in ("int-quantized", "float-quantized") and self.bits != 8:
            raise ValueError(f"{self.method} is 8-bit, not {self.bits}")
        if self.method == "awq" and (self.bits != 4 or self.sym or self.desc_act):
            raise ValueError("awq is 4-bit with zero points (sym=False) and no act order")
        if self.desc_act and self.method not in ("gptq", "pack-quantized"):
            raise ValueError(f"{self.method} has no act order")
        if self.desc_act and self.group_size is None:
            raise ValueError("act order needs groups: give a group_size")


def quantize_linear(weight: torch.Tensor, fmt: CheckpointFormat, generator: torch.Generator,
                    scale_dtype: torch.dtype) -> QuantizedWeight | torch.Tensor:
    """Round-to-nearest of one float [out, in] weight as `fmt` stores it: a QuantizedWeight whose scales are
    already rounded to scale_dtype, the dtype the checkpoint keeps them in; for FP8 the float32 weight the
    stored FP8 values and scales stand for."""
    weight = weight.float()
    out_features, in_features = weight.shape
    if fmt.method == "float-quantized":
        absmax = weight.abs().amax() if fmt.fp8_strategy == "tensor" else weight.abs().amax(dim=1, keepdim=True)
        scale = _nonzero(absmax / FP8_MAX).to(scale_dtype).float()
        return (weight / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale
    group_size = fmt.group_size or in_features
    num_groups = -(-in_features // group_size)
    group_index = None
    if fmt.desc_act:  # as GPTQ's act order: groups are runs of a column permutation
        permutation = torch.randperm(in_features, generator=generator)
        group_index = torch.empty(in_features, dtype=torch.int64)
        group_index[permutation] = torch.arange(in_features) // group_size
    groups = group_index if group_index is not None else torch.arange(in_features) // group_size
    low, high = -(1 << (fmt.bits - 1)), (1 << (fmt.bits - 1)) - 1
    scales = torch.empty(out_features, num_groups)
    zeros = None if fmt.sym else torch.empty(out_features, num_groups)
    for group in range(num_groups):
        columns = weight[:, groups == group]
        if fmt.sym:  # GPTQ's and compressed-tensors' minmax: the full [low, high] range spans +-absmax
            scales[:, group] = 2 * columns.abs().amax(dim=1) / (high - low)
        else:
            smallest, largest = columns.amin(dim=1).clamp(max=0), columns.amax(dim=1).clamp(min=0)
            scales[:, group] = (largest - smallest) / (high - low)
    scales = _nonzero(scales).to(scale_dtype).float()
    if zeros is not None:
        for group in range(num_groups):
            smallest = weight[:, groups == group].amin(dim=1).clamp(max=0)
            # GPTQ v1 stores zero - 1, so an unsigned zero point of 0 cannot be written
            lowest_zero = 1 if fmt.method == "gptq" and fmt.checkpoint_format == "gptq" else 0
            zeros[:, group] = torch.round(-smallest / scales[:, group]).clamp(lowest_zero, high - low) + low
    per_column_scales = scales[:, groups]
    q = torch.round(weight / per_column_scales)
    if zeros is not None:
        q = q + zeros[:, groups]
    return QuantizedWeight(bits=fmt.bits, qweight=q.clamp(low, high).to(torch.int8), scales=scales, zeros=zeros,
                           group_size=group_size, group_index=group_index,
                           activation="int8" if fmt.method == "int-quantized" else "float")


def _nonzero(scales: torch.Tensor) -> torch.Tensor:
    return torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero row or group


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned `bits`-bit values packed low bits first into int32 words along dim (GPTQ's and AWQ's layout)."""
    per_word = 32 // bits
    moved = values.to(torch.int64).movedim(dim, -1)
    assert moved.size(-1) % per_word == 0 and bool((moved >= 0).all()) and bool((moved < (1 << bits)).all())
    words = moved.reshape(*moved.shape[:-1], -1, per_word) << torch.arange(0, 32, bits)
    words = words.sum(dim=-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32).movedim(-1, dim).contiguous()


def pack_tensors(qw: QuantizedWeight | torch.Tensor, fmt: CheckpointFormat,
                 scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One linear's checkpoint tensors by suffix, as the producing library names and lays them out."""
    if fmt.method == "float-quantized":
        raise AssertionError("FP8 tensors are packed by pack_fp8")
    midpoint = 1 << (qw.bits - 1)
    unsigned = qw.qweight.to(torch.int32) + midpoint
    unsigned_zeros = (qw.zeros.to(torch.int32) if qw.zeros is not None
                      else torch.zeros_like(qw.scales, dtype=torch.int32)) + midpoint
    if fmt.method == "gptq":
        stored_zeros = unsigned_zeros - 1 if fmt.checkpoint_format == "gptq" else unsigned_zeros
        return {"qweight": pack_int32(unsigned.t(), qw.bits, 0), "qzeros": pack_int32(stored_zeros.t(), qw.bits, 1),
                "scales": qw.scales.t().to(torch.float16).contiguous(),
                "g_idx": qw.column_groups().to(torch.int32)}
    if fmt.method == "awq":
        # AutoAWQ's gemm order: nibble i of each word holds output column (0, 2, 4, 6, 1, 3, 5, 7)[i] of its 8
        order = torch.arange(qw.shape[0]).view(-1, 8)[:, [0, 2, 4, 6, 1, 3, 5, 7]].flatten()
        return {"qweight": pack_int32(unsigned.t()[:, order], 4, 1),
                "qzeros": pack_int32(unsigned_zeros.t()[:, order], 4, 1),
                "scales": qw.scales.t().to(torch.float16).contiguous()}
    tensors = {"weight_scale": qw.scales.to(scale_dtype)}
    if qw.zeros is not None:
        tensors["weight_zero_point"] = qw.zeros.to(torch.int8)
    if fmt.method == "int-quantized":
        return {"weight": qw.qweight.clone(), **tensors}
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    tensors["weight_packed"] = pack_to_int32(qw.qweight, qw.bits)
    tensors["weight_shape"] = torch.tensor(list(qw.shape), dtype=torch.int64)
    if qw.zeros is not None:
        tensors["weight_zero_point"] = pack_to_int32(qw.zeros.to(torch.int8), qw.bits, packed_dim=0)
    if qw.group_index is not None:
        tensors["weight_g_idx"] = qw.group_index.to(torch.int32)
    return tensors


def pack_fp8(weight: torch.Tensor, fmt: CheckpointFormat, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """compressed-tensors float-quantized tensors of a float weight (the same rounding as quantize_linear)."""
    weight = weight.float()
    absmax = weight.abs().amax().reshape(1) if fmt.fp8_strategy == "tensor" \
        else weight.abs().amax(dim=1, keepdim=True)
    scale = _nonzero(absmax / FP8_MAX).to(scale_dtype)
    return {"weight": (weight / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn),
            "weight_scale": scale}


def quantization_config(fmt: CheckpointFormat) -> dict:
    """The `quantization_config` the producing tool writes into config.json."""
    if fmt.method == "gptq":
        return {"quant_method": "gptq", "bits": fmt.bits, "group_size": fmt.group_size or -1,
                "desc_act": fmt.desc_act, "sym": fmt.sym, "damp_percent": 0.01, "static_groups": False,
                "true_sequential": True, "checkpoint_format": fmt.checkpoint_format, "lm_head": False,
                "model_name_or_path": None, "model_file_base_name": None}
    if fmt.method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": fmt.group_size or -1, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}
    if fmt.method == "float-quantized":
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": fmt.fp8_strategy,
                   "group_size": None, "dynamic": False, "actorder": None, "block_structure": None,
                   "observer": "minmax", "observer_kwargs": {}}
        inputs = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "group_size": None,
                  "dynamic": True, "actorder": None, "block_structure": None, "observer": None,
                  "observer_kwargs": {}}
    else:
        weights = {"num_bits": fmt.bits, "type": "int", "symmetric": fmt.sym,
                   "strategy": "group" if fmt.group_size else "channel", "group_size": fmt.group_size,
                   "dynamic": False, "actorder": "group" if fmt.desc_act else None, "block_structure": None,
                   "observer": "minmax", "observer_kwargs": {}}
        inputs = None if fmt.method == "pack-quantized" else {
            "num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "group_size": None,
            "dynamic": True, "actorder": None, "block_structure": None, "observer": None, "observer_kwargs": {}}
    return {"quant_method": "compressed-tensors", "format": fmt.method, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
                                          "output_activations": None}},
            "ignore": ["lm_head"], "kv_cache_scheme": None, "global_compression_ratio": None,
            "sparsity_config": {}}


def _read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    assert files, f"no safetensors in {path}"
    state = {}
    for file in files:
        state.update(load_file(file))
    return state


def _copy_with_config(float_dir: str, out_dir: str, state: dict[str, torch.Tensor], edit_config) -> None:
    """out_dir: float_dir's side files (tokenizer, generation config), `state` in one safetensors file and
    config.json as edit_config leaves it."""
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(float_dir):
        if not name.endswith(".safetensors") and name not in ("config.json", "model.safetensors.index.json") \
                and os.path.isfile(os.path.join(float_dir, name)):
            shutil.copy(os.path.join(float_dir, name), out_dir)
    with open(os.path.join(float_dir, "config.json")) as f:
        config = json.load(f)
    edit_config(config)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file({name: tensor.contiguous() for name, tensor in state.items()},
              os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


def shared_input(module: str) -> str:
    """Linears that read the same input (q/k/v; gate/up) get one act order: GPTQ orders columns by the
    input's statistics, so they share g_idx, as the engine's packed projections require."""
    return re.sub(r"\.(gate|up)_proj$", ".gate_up", re.sub(r"\.[qkv]_proj$", ".qkv", module))


def write_quantized_checkpoint(float_dir: str, out_dir: str,
                               fmt: CheckpointFormat) -> dict[str, QuantizedWeight | torch.Tensor]:
    """Writes the quantized checkpoint; returns module name -> what its tensors stand for."""
    state = _read_checkpoint(float_dir)
    written, quantized_state = {}, {}
    for name in sorted(state):
        module, _, suffix = name.rpartition(".")
        tensor = state[name]
        if suffix != "weight" or not QUANTIZED_LINEAR.match(module):
            quantized_state[name] = tensor
            continue
        generator = torch.Generator().manual_seed(fmt.seed * 1_000_003 + zlib.crc32(shared_input(module).encode()))
        # GPTQ and AWQ keep fp16 scales; compressed-tensors keeps the model's dtype
        scale_dtype = torch.float16 if fmt.method in ("gptq", "awq") else tensor.dtype
        if fmt.method == "float-quantized":
            tensors = pack_fp8(tensor, fmt, scale_dtype)
            written[module] = tensors["weight"].float() * tensors["weight_scale"].float()
            assert torch.equal(written[module], quantize_linear(tensor, fmt, generator, scale_dtype))
        else:
            written[module] = quantize_linear(tensor, fmt, generator, scale_dtype)
            tensors = pack_tensors(written[module], fmt, scale_dtype)
        quantized_state.update({f"{module}.{suffix}": value for suffix, value in tensors.items()})
    assert written, f"no decoder-layer linear in {float_dir}"

    def add_quantization_config(config: dict) -> None:
        config["quantization_config"] = quantization_config(fmt)

    _copy_with_config(float_dir, out_dir, quantized_state, add_quantization_config)
    return written


def write_reference_checkpoint(float_dir: str, out_dir: str, written: dict[str, QuantizedWeight | torch.Tensor]) -> None:
    """The float32 checkpoint that computes what the quantized one stands for: transformers' oracle."""
    state = {}
    for name, tensor in _read_checkpoint(float_dir).items():
        module = name.removesuffix(".weight")
        if module in written:
            value = written[module]
            state[name] = value.dequantize() if isinstance(value, QuantizedWeight) else value.float()
        else:
            state[name] = tensor.float() if tensor.is_floating_point() else tensor

    def make_float32(config: dict) -> None:
        config.pop("quantization_config", None)
        for key in ("torch_dtype", "dtype"):
            if key in config:
                config[key] = "float32"

    _copy_with_config(float_dir, out_dir, state, make_float32)


def write_quantized_and_reference(float_dir: str, quantized_dir: str, reference_dir: str,
                                  fmt: CheckpointFormat) -> dict[str, QuantizedWeight | torch.Tensor]:
    written = write_quantized_checkpoint(float_dir, quantized_dir, fmt)
    write_reference_checkpoint(float_dir, reference_dir, written)
    return written
