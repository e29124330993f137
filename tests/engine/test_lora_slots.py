"""The LoRA slot ledger on its own: a slot is held with a sequence's blocks, idle slots are evicted oldest first,
a sequence waits while every slot serves running ones, and an interrupted step's loads are forgotten; the
scheduler gives each step its loads and rows their slots, and roots each adapter's block hashes apart."""
from tpengine.engine.block_manager import chain_root
from tpengine.engine.lora_slots import LoRASlots
from tpengine.engine.scheduler import Scheduler
from tpengine.engine.sequence import Sequence
from tpengine.lora.request import LoRARequest
from tpengine.sampling_params import SamplingParams

A, B, C = (LoRARequest(name, i, f"/adapters/{name}") for i, name in enumerate("abc", start=1))


def seq(lora=None, tokens=(1, 2, 3)) -> Sequence:
    return Sequence(list(tokens), SamplingParams(max_tokens=4), 16, lora=lora)


def test_slots_are_shared_by_an_adapter_and_evicted_only_when_idle_oldest_first():
    slots = LoRASlots(2)
    s1, s2, s3 = seq(A), seq(A), seq(B)
    for s, adapter in ((s1, A), (s2, A), (s3, B)):
        assert slots.can_take(adapter)
        slots.take(s, adapter)
    assert s1.lora_slot == s2.lora_slot != s3.lora_slot
    assert [(load.slot, load.lora_int_id) for load in slots.take_loads()] == [(0, 1), (1, 2)]
    assert not slots.can_take(C)  # both slots serve running sequences: C waits
    slots.give_back(s1)
    assert not slots.can_take(C)  # s2 still uses A
    slots.give_back(s3)
    slots.give_back(s2)
    assert slots.can_take(C)
    s4 = seq(C)
    slots.take(s4, C)  # B's slot went idle first: C takes it
    assert s4.lora_slot == 1 and [load.slot for load in slots.take_loads()] == [1]
    s5 = seq(A)
    slots.take(s5, A)  # A is still in its slot: no load
    assert s5.lora_slot == 0 and slots.take_loads() == []


def test_an_interrupted_steps_loads_are_forgotten_and_repeated():
    slots = LoRASlots(1)
    s = seq(A)
    slots.take(s, A)
    loads = slots.take_loads()
    slots.give_back(s)
    slots.forget_loads(loads)
    slots.take(s, A)
    assert [load.lora_int_id for load in slots.take_loads()] == [1]


def test_the_scheduler_sends_loads_and_row_slots_and_a_full_set_of_slots_holds_requests_back():
    slots = LoRASlots(1)
    scheduler = Scheduler(num_kvcache_blocks=16, kvcache_block_size=16, max_num_seqs=8, max_num_batched_tokens=64,
                          max_model_len=64, eos_token_ids=frozenset(), lora_slots=slots)
    first, other, base = seq(A, (1, 2, 3)), seq(B, (4, 5)), seq(None, (6, 7))
    for s in (first, other, base):
        scheduler.add(s)
    message = scheduler.schedule().message
    # B's request waits for A's slot; the base request does not wait for any
    assert [chunk.seq_id for chunk in message.prefill] == [first.seq_id, base.seq_id]
    assert [chunk.lora_slot for chunk in message.prefill] == [0, -1]
    assert [(load.slot, load.path) for load in message.lora_loads] == [(0, "/adapters/a")]


def test_block_hashes_are_rooted_in_the_adapter():
    roots = {chain_root(seq(lora)) for lora in (None, A, B)}
    assert len(roots) == 3
    assert chain_root(seq(A)) == chain_root(seq(LoRARequest("a-again", 1, "/adapters/a")))
