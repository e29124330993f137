"""Reading a Hugging Face config the same way under transformers 4 and 5, and refusing what we do not implement.

Every check here runs on rank 0 before any worker starts; none of it imports torch.
"""
from dataclasses import dataclass

from transformers import PretrainedConfig

SILU_ACTIVATIONS = ("silu", "swish")  # transformers' ACT2FN maps both to SiLU
LAYER_TYPES = ("full_attention", "sliding_attention")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


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

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope type {self.rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_parameters_of(config: PretrainedConfig) -> RopeParameters:
    """The checkpoint's rotary settings; ValueError naming a rope type or setting we do not implement."""
    # transformers 5 keeps them in rope_parameters (with rope_theta); 4 in rope_scaling, theta at the top level
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if any(isinstance(value, dict) for value in params.values()):
        raise ValueError("per-layer-type rope parameters are not supported")
    rope_type = params.get("rope_type") or params.get("type") or "default"
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("config has no rope_theta (neither at the top level nor in rope_parameters)")
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor={partial} is not supported; rotary must cover the whole head")
    if rope_type == "default":
        return RopeParameters(theta=float(theta))
    original = (params.get("original_max_position_embeddings")
                or getattr(config, "original_max_position_embeddings", None) or config.max_position_embeddings)
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
    return RopeParameters(theta=float(theta), rope_type=rope_type, factor=float(factor),
                          original_max_position=int(original), **optional)


def sliding_window_of(config: PretrainedConfig) -> int | None:
    """The attention window of the checkpoint's sliding-window layers, or None when every layer attends fully."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:  # transformers 5 (Qwen2, Qwen3): which layers slide is spelled out
        return window if "sliding_attention" in layer_types else None
    # Mistral and Qwen3-MoE slide in every layer whenever a window is set; transformers 4's Qwen2/Qwen3 from
    # max_window_layers on (capping for those too only ever shortens max_model_len, never changes a token)
    return window if getattr(config, "use_sliding_window", True) else None


def max_positions_of(config: PretrainedConfig) -> int:
    """The positions the model can encode: max_position_embeddings, or YaRN's extended window when longer
    (Qwen2.5 checkpoints keep the original 32k there and add yarn to reach factor x 32k)."""
    rope = rope_parameters_of(config)
    if rope.rope_type == "yarn":
        return max(config.max_position_embeddings, int(rope.original_max_position * rope.factor))
    return config.max_position_embeddings


def max_model_len_of(config: PretrainedConfig, requested: int) -> tuple[int, str | None]:
    """The longest sequence the engine may run, and a line saying why when the model's window shortened it.

    Attention here always sees the whole sequence; within a sliding window that is exactly what the
    model computes, so a window shorter than the request caps the length instead of changing tokens.
    """
    limit = min(requested, max_positions_of(config))
    window = sliding_window_of(config)
    if window is not None and window < limit:
        return window, (f"max_model_len capped from {limit} to the model's sliding_window={window}: "
                        "attention beyond the window is not implemented")
    return limit, None


def check_supported(config: PretrainedConfig) -> None:
    """ValueError naming the first setting of this checkpoint that the shared decoder does not implement."""
    activation = getattr(config, "hidden_act", "silu")
    if activation not in SILU_ACTIVATIONS:
        raise ValueError(f"hidden_act={activation!r} is not supported; only 'silu' gated MLPs are")
    if getattr(config, "quantization_config", None):
        quantization = config.quantization_config
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
        raise ValueError(f"quantized checkpoints (quantization_config, quant_method={method!r}) are not supported")
    unknown = sorted(set(getattr(config, "layer_types", None) or ()) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported; supported: {', '.join(LAYER_TYPES)}")
    num_experts = getattr(config, "num_experts", None) or 0
    if num_experts and not 1 <= config.num_experts_per_tok <= num_experts:
        raise ValueError(f"num_experts_per_tok={config.num_experts_per_tok} must be between 1 and "
                         f"num_experts={num_experts}")
    rope_parameters_of(config)


def is_sparse_layer(config: PretrainedConfig, layer_idx: int) -> bool:
    """Whether this layer's MLP is a mixture of experts (Qwen3-MoE's rule); False for dense models."""
    num_experts = getattr(config, "num_experts", None) or 0
    step = getattr(config, "decoder_sparse_step", None) or 1
    mlp_only = getattr(config, "mlp_only_layers", None) or ()
    return num_experts > 0 and layer_idx not in mlp_only and (layer_idx + 1) % step == 0


def tensor_parallel_sizes(config: PretrainedConfig) -> dict[str, int]:
    """The MLP sizes the tensor-parallel size must divide: each rank holds a slice of every one."""
    sparse = [is_sparse_layer(config, i) for i in range(config.num_hidden_layers)]
    sizes = {}
    if not all(sparse):
        sizes["intermediate_size"] = config.intermediate_size
    if any(sparse):
        sizes["moe_intermediate_size"] = config.moe_intermediate_size
    return sizes
