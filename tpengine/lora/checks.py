"""Rank 0's check of each adapter a request names, once per adapter: it must run on this engine's model before
any rank reads it (a worker that failed on it would stop the engine; a request's ValueError stops nothing)."""
import re

from tpengine.config import EngineConfig
from tpengine.hf_config import HFConfig, head_dim_of, is_sparse_layer
from tpengine.lora.adapter import adapter_shapes, read_adapter_config
from tpengine.lora.request import LoRARequest

MODULE_PATH = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)")


def expected_shapes(hf_config: HFConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection an adapter may target, by its short name."""
    hidden, head_dim = hf_config.hidden_size, head_dim_of(hf_config)
    q, kv = hf_config.num_attention_heads * head_dim, hf_config.num_key_value_heads * head_dim
    intermediate = hf_config.intermediate_size
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "qkv_proj": (hidden, q + 2 * kv),
            "o_proj": (q, hidden), "gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate),
            "gate_up_proj": (hidden, 2 * intermediate), "down_proj": (intermediate, hidden)}


class LoRAAdapterChecks:
    """The adapters requests named so far (by lora_int_id), each checked against the model once."""

    def __init__(self, config: EngineConfig, hf_config: HFConfig):
        self.enabled = config.enable_lora
        self.max_lora_rank = config.max_lora_rank
        self.hf_config = hf_config
        self.shapes = expected_shapes(hf_config)
        self.checked: dict[int, LoRARequest] = {}

    def check(self, lora_request) -> None:
        if not self.enabled:
            raise ValueError("lora_request needs an engine made with enable_lora=True (--enable-lora)")
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        known = self.checked.get(lora_request.lora_int_id)
        if known is not None:
            if known.lora_path != lora_request.lora_path:
                raise ValueError(f"lora_int_id {lora_request.lora_int_id} is adapter {known.lora_name!r} at "
                                 f"{known.lora_path!r}; another adapter needs another id")
            return
        path = lora_request.lora_path
        config = read_adapter_config(path, self.max_lora_rank)  # ValueError naming what is wrong
        for module, (a_shape, b_shape) in adapter_shapes(path, config).items():
            self._check_module(path, module, a_shape, b_shape)
        self.checked[lora_request.lora_int_id] = lora_request

    def _check_module(self, path: str, module: str, a_shape: tuple, b_shape: tuple) -> None:
        match = MODULE_PATH.fullmatch(module)
        num_layers = self.hf_config.num_hidden_layers
        if match is None or int(match.group(1)) >= num_layers:
            raise ValueError(f"LoRA adapter {path}: {module} is not a projection of this model's {num_layers} "
                             "decoder layers (model.layers.N.self_attn.* or model.layers.N.mlp.*)")
        layer, block, name = int(match.group(1)), match.group(2), match.group(3)
        if block == "mlp" and is_sparse_layer(self.hf_config, layer):
            raise ValueError(f"LoRA adapter {path}: {module} is in a mixture-of-experts MLP; LoRA on experts is "
                             "not supported")
        in_features, out_features = self.shapes[name]
        if a_shape[1] != in_features or b_shape[0] != out_features:
            raise ValueError(f"LoRA adapter {path}: {module} is [{a_shape[1]} -> {b_shape[0]}] features, this "
                             f"model's {name} is [{in_features} -> {out_features}]: the adapter is for another model")

    def forget(self, lora_int_id: int) -> bool:
        return self.checked.pop(lora_int_id, None) is not None
