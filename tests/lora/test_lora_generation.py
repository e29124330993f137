"""Multi-LoRA generation against transformers + peft: greedy tokens equal for batches mixing three adapters of
different ranks and targets with the base model, through chunked prefill, prefix-cache hits, preemption and
slot eviction (more adapters than slots), at tp 1 and 2."""
import functools

import pytest
import torch

from tests.quantization.checkpoints import CheckpointFormat, write_quantized_and_reference
from tests.lora.adapters import ATTENTION, MLP, PHI3_FUSED, load_peft_model, make_peft_adapter, write_tiny_base
from tpengine import LLM, SamplingParams
from tpengine.sampling_params import StructuredOutputsParams
from tpengine.lora.request import LoRARequest

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """The base checkpoint and three adapters: rank 4 on attention, rank 8 rsLoRA on the MLP, rank 16 on both."""
    folder = tmp_path_factory.mktemp("lora")
    base = write_tiny_base(str(folder / "base"))
    return base, [
        LoRARequest("attention", 1, make_peft_adapter(base, str(folder / "a1"), r=4, alpha=8, targets=ATTENTION,
                                                      seed=1)),
        LoRARequest("mlp", 2, make_peft_adapter(base, str(folder / "a2"), r=8, alpha=16, targets=MLP, seed=2,
                                                use_rslora=True)),
        LoRARequest("all", 3, make_peft_adapter(base, str(folder / "a3"), r=16, alpha=32, seed=3)),
    ]


def mixed_batch(loras: list[LoRARequest]) -> tuple[list[list[int]], list[LoRARequest | None]]:
    """Prompts of different lengths, each on an adapter or the base; the same prompt under two adapters and
    prompts sharing a prefix within one adapter (prefix-cache hits only within an adapter)."""
    shared = [7 + 5 * j % 300 for j in range(40)]
    prompts = [[5 + i + 3 * j for j in range(10 + 7 * i)] for i in range(6)] + [shared, shared, shared + [9, 8, 7]]
    choice = [loras[0], loras[1], None, loras[2], loras[0], None, loras[1], loras[2], loras[2]]
    return prompts, choice


@functools.cache
def _reference_model(base: str, adapter_path: str | None):
    from transformers import AutoModelForCausalLM
    if adapter_path is None:
        return AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    return load_peft_model(base, adapter_path)


def peft_greedy(base: str, prompts, loras) -> list[list[int]]:
    outputs = []
    with torch.inference_mode():
        for prompt, lora in zip(prompts, loras):
            model = _reference_model(base, None if lora is None else lora.lora_path)
            out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0,
                                 eos_token_id=None, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


def our_greedy(llm: LLM, prompts, loras) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)]


@pytest.mark.parametrize("settings", [
    # two slots for three adapters (evictions and reloads), 16-token blocks, 24-token chunks, a cache small enough
    # to preempt
    dict(tensor_parallel_size=1, kvcache_block_size=16, max_num_batched_tokens=24, num_kvcache_blocks=10),
    dict(tensor_parallel_size=2, kvcache_block_size=256, max_num_batched_tokens=32),
    dict(pipeline_parallel_size=2, kvcache_block_size=16),
], ids=["tp1-block16-preempting", "tp2-block256", "pp2"])
def test_a_batch_mixing_three_adapters_and_the_base_equals_peft(adapters, settings):
    base, loras = adapters
    prompts, choice = mixed_batch(loras)
    expected = peft_greedy(base, prompts, choice)
    assert len({tuple(tokens) for tokens in expected[6:8]}) == 2, "two adapters on one prompt must differ"
    llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=16, **settings)
    try:
        assert our_greedy(llm, prompts, choice) == expected
        # again: every prompt now hits the prefix cache within its own adapter, and the adapters were evicted
        # and read back (the host cache of max_cpu_loras = max_loras holds two of the three)
        hits = llm.prefix_cache_hits
        assert our_greedy(llm, prompts, choice) == expected
        assert llm.prefix_cache_hits > hits
        if "num_kvcache_blocks" in settings:
            assert llm.num_preemptions > 0
        if "pipeline_parallel_size" not in settings:  # the adapters' rows replayed in recorded CPU decode steps
            replays = llm.executor.runner.decode_path.replays
            assert any(replay is not None for replay in replays.replays.values())
        assert llm.lora_slots.num_loads > 3
    finally:
        llm.shutdown()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_verifies_an_adapters_drafts_with_the_adapter(adapters, method):
    """n-gram or a draft model (the base itself, which runs without adapters) proposes; the verify rows run on
    each row's adapter: the tokens stay peft's."""
    base, loras = adapters
    prompts, choice = mixed_batch(loras)
    expected = peft_greedy(base, prompts, choice)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1} \
        if method == "ngram" else {"model": base, "num_speculative_tokens": 2}
    llm = LLM(base, enable_lora=True, max_loras=3, max_lora_rank=16, kvcache_block_size=16, speculative_config=spec)
    try:
        assert our_greedy(llm, prompts, choice) == expected
    finally:
        llm.shutdown()


@pytest.mark.parametrize("fmt", [CheckpointFormat("gptq", bits=4, group_size=32, desc_act=True),
                                 CheckpointFormat("awq", bits=4, group_size=32)], ids=["gptq-4bit", "awq-4bit"])
def test_adapters_on_a_quantized_base_equal_peft_on_the_weights_it_stands_for(adapters, fmt, tmp_path):
    """QLoRA serving: the adapters add to a GPTQ or AWQ base's linears; the oracle is peft on the float32
    checkpoint of what the quantized weights stand for."""
    base, loras = adapters
    quantized, reference = str(tmp_path / "quantized"), str(tmp_path / "reference")
    write_quantized_and_reference(base, quantized, reference, fmt)
    prompts, choice = mixed_batch(loras)
    expected = peft_greedy(reference, prompts, choice)
    llm = LLM(quantized, enable_lora=True, max_loras=3, max_lora_rank=16, kvcache_block_size=16)
    try:
        assert our_greedy(llm, prompts, choice) == expected
    finally:
        llm.shutdown()


def test_phi3s_fused_qkv_and_gate_up_adapters_equal_peft_at_tp_2(tmp_path):
    """One A for q, k and v (and for gate and up): each part's rows of B go to its own output columns."""
    base = write_tiny_base(str(tmp_path / "phi3"), architecture="Phi3ForCausalLM")
    loras = [LoRARequest("fused", 1, make_peft_adapter(base, str(tmp_path / "a"), r=8, targets=PHI3_FUSED, seed=6))]
    prompts, choice = [[5, 6, 7, 8], [9, 10, 11], [12, 13]], [loras[0], None, loras[0]]
    llm = LLM(base, enable_lora=True, max_lora_rank=8, kvcache_block_size=16, tensor_parallel_size=2)
    try:
        assert our_greedy(llm, prompts, choice) == peft_greedy(base, prompts, choice)
    finally:
        llm.shutdown()


def test_structured_outputs_hold_on_an_adapter(adapters):
    base, loras = adapters
    llm = LLM(base, enable_lora=True, max_loras=1, max_lora_rank=16, kvcache_block_size=16)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=12,
                                structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"]))
        outputs = llm.generate(["Is it?", "Is it not?"], params, use_tqdm=False, lora_request=loras[2])
        assert all(out.outputs[0].text in ("yes", "no", "maybe") for out in outputs)
    finally:
        llm.shutdown()


def test_bad_adapters_are_value_errors_and_others_still_run(adapters, tmp_path):
    base, loras = adapters
    wide = LoRARequest("wide", 9, make_peft_adapter(base, str(tmp_path / "wide"), r=32, alpha=32, seed=4))
    other_base = write_tiny_base(str(tmp_path / "other"), hidden_size=96, intermediate_size=160)
    foreign = LoRARequest("foreign", 10, make_peft_adapter(other_base, str(tmp_path / "foreign"), r=4, seed=5))
    llm = LLM(base, enable_lora=True, max_loras=1, max_lora_rank=16, kvcache_block_size=16)
    try:
        with pytest.raises(ValueError, match="adapter rank 32 is more than max_lora_rank=16"):
            llm.generate([[1, 2, 3]], GREEDY, lora_request=wide)
        with pytest.raises(ValueError, match="the adapter is for another model"):
            llm.generate([[1, 2, 3]], GREEDY, lora_request=foreign)
        with pytest.raises(ValueError, match="lora_int_id 1 is adapter 'attention'"):
            llm.add_lora(loras[0])
            llm.generate([[1, 2, 3]], GREEDY, lora_request=LoRARequest("x", 1, loras[1].lora_path))
        with pytest.raises(ValueError, match="no such folder"):
            llm.generate([[1, 2, 3]], GREEDY, lora_request=LoRARequest("gone", 11, str(tmp_path / "gone")))
        with pytest.raises(ValueError, match="got 1 lora_request for 2 prompts"):
            llm.generate([[1, 2, 3], [4, 5]], GREEDY, lora_request=[loras[0]])
        # one slot, two adapters: the second waits for the first's requests, none is refused
        prompts, choice = [[1, 2, 3], [4, 5, 6], [7, 8]], [loras[0], loras[1], loras[0]]
        assert our_greedy(llm, prompts, choice) == peft_greedy(base, prompts, choice)
        assert llm.remove_lora(1) and not llm.remove_lora(1)
    finally:
        llm.shutdown()
