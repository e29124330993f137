"""A rank's LoRA adapters: the slots on its model's linears (layers/lora.py), the adapters it has read (an LRU of
max_cpu_loras in host memory, so one evicted from its slot comes back without a read), the loads each step
carries applied before its forward, and the step's row slots."""
from collections import OrderedDict

import numpy as np
import torch

from tpengine.config import EngineConfig
from tpengine.distributed.messages import LoRALoad
from tpengine.layers.lora import LoRARows, attach_lora
from tpengine.lora.adapter import read_adapter_config, read_adapter_weights


class LoRAAdapters:
    def __init__(self, model: torch.nn.Module, config: EngineConfig, dtype: torch.dtype, device: torch.device,
                 max_num_rows: int):
        self.model = model
        self.max_lora_rank = config.max_lora_rank
        self.one_stage = config.pipeline_parallel_size == 1
        self.layers = attach_lora(model, config.max_loras, config.max_lora_rank, max_num_rows, dtype, device,
                                  config.batch_invariant)
        self.rows: LoRARows | None = next(iter(self.layers.values())).rows if self.layers else None
        self.max_cpu_loras = config.max_cpu_loras or config.max_loras
        self.read: OrderedDict[int, dict[str, dict]] = OrderedDict()  # lora_int_id -> parts by our layer name

    def apply(self, loads: list[LoRALoad]) -> None:
        for load in loads:
            parts = self._parts_of(load)
            for name, layer in self.layers.items():
                layer.write_slot(load.slot, parts.get(name, {}))

    def set_rows(self, slots: np.ndarray) -> None:
        if self.rows is not None:
            self.rows.set(torch.from_numpy(slots))

    def _parts_of(self, load: LoRALoad) -> dict[str, dict]:
        """The adapter's weights by our layer name, then by the layer's shard id (q/k/v, gate/up, None for a
        whole layer): from the host cache, else read from its folder."""
        parts = self.read.get(load.lora_int_id)
        if parts is not None:
            self.read.move_to_end(load.lora_int_id)
            return parts
        weights = read_adapter_weights(load.path, read_adapter_config(load.path, self.max_lora_rank))
        parts = {}
        for module, part in weights.items():
            target, args = self.model.checkpoint_target(f"{module}.weight")
            if target is None and self.one_stage:  # no layer of this model: never silently left out
                raise ValueError(f"LoRA adapter {load.path!r} targets {module!r}, which this model does not have")
            if target is None:  # another pipeline stage's layer
                continue
            name = target.removesuffix(".weight")
            if name not in self.layers:
                raise ValueError(f"LoRA adapter {load.path!r} targets {module!r}, which has no LoRA slots here")
            parts.setdefault(name, {})[args[0] if args else None] = part
        self.read[load.lora_int_id] = parts
        while len(self.read) > self.max_cpu_loras:
            self.read.popitem(last=False)
        return parts

