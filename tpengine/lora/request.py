"""A request's LoRA adapter, as vLLM's LoRARequest spells it: a name, an integer id unique per adapter, a path."""
import msgspec


class LoRARequest(msgspec.Struct, frozen=True):
    """lora_name: what the server lists it as (a request's `model`); lora_int_id: >= 1, one per adapter (the
    prefix cache and the adapter slots key on it); lora_path: a PEFT adapter folder (adapter_config.json and
    adapter_model.safetensors or .bin)."""
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")

    # vLLM's short names
    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path
