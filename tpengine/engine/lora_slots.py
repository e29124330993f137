"""Which LoRA adapter each of the ranks' max_loras slots holds, and who uses it: rank 0's ledger (no tensors).

A sequence takes its adapter's slot when it gets KV-cache blocks (admission, or a fork of its parent's) and gives
it back with them. An adapter not in a slot goes into a free one, else into the one idle longest (no sequence
holding blocks uses it): the step that admits the sequence carries the load, which every rank applies before its
forward. When every slot holds an adapter in use, the sequence waits; it is never refused. Shared by every
scheduler of the engine (one per pipeline step in flight): a slot is only ever reloaded while no step in flight
reads it."""
from collections import OrderedDict

from tpengine.distributed.messages import LoRALoad
from tpengine.engine.sequence import Sequence
from tpengine.lora.request import LoRARequest


class LoRASlots:
    def __init__(self, max_loras: int):
        self.adapter_in_slot: list[int] = [0] * max_loras    # lora_int_id per slot; 0: empty
        self.num_users: list[int] = [0] * max_loras          # sequences holding blocks with the slot's adapter
        self.idle: OrderedDict[int, None] = OrderedDict()   # loaded slots nobody uses, longest idle first
        self.slot_of: dict[int, int] = {}                   # lora_int_id -> slot
        self.loads: list[LoRALoad] = []                     # for the next step's message
        self.num_loads = 0

    def can_take(self, adapter: LoRARequest) -> bool:
        """Whether a sequence of adapter could take a slot now."""
        return adapter.lora_int_id in self.slot_of or bool(self.idle) or 0 in self.adapter_in_slot

    def take(self, seq: Sequence, adapter: LoRARequest) -> None:
        """seq (getting blocks now) uses adapter's slot, loaded into one first if need be (can_take said it may)."""
        slot = self.slot_of.get(adapter.lora_int_id)
        if slot is None:
            slot = self._free_slot()
            self.adapter_in_slot[slot] = adapter.lora_int_id
            self.slot_of[adapter.lora_int_id] = slot
            self.loads.append(LoRALoad(slot, adapter.lora_int_id, adapter.lora_path))
            self.num_loads += 1
        if self.num_users[slot] == 0:
            self.idle.pop(slot, None)
        self.num_users[slot] += 1
        seq.lora_slot = slot

    def give_back(self, seq: Sequence) -> None:
        """seq gave its blocks back: its slot is idle once no one else uses it."""
        slot = seq.lora_slot
        if slot < 0:
            return
        seq.lora_slot = -1
        self.num_users[slot] -= 1
        assert self.num_users[slot] >= 0, "a LoRA slot given back more often than taken"
        if self.num_users[slot] == 0:
            self.idle[slot] = None

    def take_loads(self) -> list[LoRALoad]:
        loads, self.loads = self.loads, []
        return loads

    def forget_loads(self, loads: list[LoRALoad]) -> None:
        """A step that carried loads never ran to its end (interrupted): no one knows whether the ranks applied
        them, so each such slot nobody uses counts as empty (its adapter is loaded again when next needed)."""
        for load in loads:
            if self.num_users[load.slot] == 0 and self.adapter_in_slot[load.slot] == load.lora_int_id:
                self._empty(load.slot)

    def forget_adapter(self, lora_int_id: int) -> None:
        """An adapter removed (the server's unload): its slot empties once its last sequence gives it back; until
        then it serves them."""
        slot = self.slot_of.get(lora_int_id)
        if slot is not None and self.num_users[slot] == 0:
            self._empty(slot)

    def _free_slot(self) -> int:
        if 0 in self.adapter_in_slot:
            return self.adapter_in_slot.index(0)
        slot, _ = self.idle.popitem(last=False)
        del self.slot_of[self.adapter_in_slot[slot]]
        return slot

    def _empty(self, slot: int) -> None:
        self.idle.pop(slot, None)
        del self.slot_of[self.adapter_in_slot[slot]]
        self.adapter_in_slot[slot] = 0
