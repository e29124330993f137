"""Reading a Hugging Face config the same way under transformers 4 and 5."""
from transformers import PretrainedConfig


def rope_theta_of(config: PretrainedConfig) -> float:
    # transformers 5 moved rope_theta into rope_parameters; 4 keeps it at the top level.
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope type {rope_type!r} is not supported; only the default rotary embedding is")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("config has no rope_theta (neither at the top level nor in rope_parameters)")
    return float(theta)


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
