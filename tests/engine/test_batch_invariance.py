"""batch_invariant=True: one request's tokens, logprobs and prompt logprobs are the same bits alone and in 30
random batch mixes (other prompts of random lengths, before and after it in the batch, some sharing its prefix so
it hits the prefix cache, chunked prefill cutting its prompt at different places), on the CPU kernels (float32,
bfloat16 weights, int8), through the torch backend, and at tp 2; the settings it does not cover are ValueErrors.
(Without it the same mixes change the logprobs' low bits: the matmuls' and attention's sums follow the batch.)"""
import random

import pytest

from tests.conftest import TP_MODEL
from tpengine import LLM, SamplingParams
from tpengine.tiny_model import write_tiny_model

SETTINGS = dict(max_model_len=512, kvcache_block_size=16, max_num_batched_tokens=64, batch_invariant=True)
TARGET = [(7 * i + 3) % 900 + 10 for i in range(203)]  # several chunks, a partial last block
GREEDY = SamplingParams(max_tokens=12, temperature=0, logprobs=5, prompt_logprobs=3, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=11, logprobs=2, ignore_eos=True)


def mixes(count: int, seed: int, target=TARGET, longest: int = 150, most: int = 8, vocab: int = 1000):
    """(other prompts, the target's index among them) for count random batches of up to most others."""
    rng = random.Random(seed)
    batches = []
    for _ in range(count):
        others = [[rng.randrange(10, vocab) for _ in range(rng.randrange(1, longest))]
                  for _ in range(rng.randrange(0, most + 1))]
        if rng.random() < 0.4:  # a prompt sharing the target's first blocks: the target may hit them in the cache
            others.append(target[:rng.randrange(16, len(target))] + [rng.randrange(10, vocab)])
        batches.append((others, rng.randrange(len(others) + 1)))
    return batches


def target_result(llm: LLM, others: list[list[int]], index: int, params: SamplingParams, target=TARGET,
                  adapters: list | None = None):
    """The target's output in a batch with others; adapters: the target's LoRARequest, then one per other prompt
    (None: the base) chosen round robin."""
    prompts = others[:index] + [target] + others[index:]
    other = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    loras = None
    if adapters is not None:
        rest = [adapters[1 + i % (len(adapters) - 1)] for i in range(len(others))]
        loras = rest[:index] + [adapters[0]] + rest[index:]
    output = llm.generate(prompts, [other] * index + [params] + [other] * (len(others) - index), use_tqdm=False,
                          lora_request=loras)[index]
    completion = output.outputs[0]
    return completion.token_ids, completion.logprobs, completion.cumulative_logprob, output.prompt_logprobs


def assert_invariant(llm: LLM, params: SamplingParams, num_mixes: int, seed: int, target=TARGET, adapters=None,
                     **mix_sizes) -> None:
    alone = target_result(llm, [], 0, params, target, adapters)
    assert len(alone[0]) == params.max_tokens
    for mix, (others, index) in enumerate(mixes(num_mixes, seed, target, **mix_sizes)):
        assert target_result(llm, others, index, params, target, adapters) == alone, \
            f"mix {mix}: {len(others)} others, row {index}"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return write_tiny_model(str(tmp_path_factory.mktemp("batch_invariant")), seed=12, **TP_MODEL)


def test_a_request_is_the_same_bits_alone_and_in_30_random_batch_mixes(model):
    with LLM(model, dtype="float32", **SETTINGS) as llm:
        assert_invariant(llm, GREEDY, 30, seed=0)
        assert_invariant(llm, SAMPLED, 8, seed=1)  # a seeded sampled request draws from the same bits


@pytest.mark.parametrize("settings", [dict(dtype="bfloat16"), dict(dtype="float32", quantization="int8"),
                                      dict(dtype="float32", attention_backend="torch", enforce_eager=True),
                                      dict(dtype="float32", tensor_parallel_size=2)],
                         ids=["bf16", "int8", "torch-eager", "tp2"])
def test_every_cpu_path_is_batch_invariant(model, settings):
    with LLM(model, **SETTINGS, **settings) as llm:
        assert_invariant(llm, GREEDY, 6, seed=2)


def test_the_triton_kernels_are_batch_invariant_in_the_interpreter(model):
    """The CUDA path's attention (Triton's decode kernel, one program per row and head, no key splits), run by
    Triton's interpreter: a short prompt, two mixes (the interpreter is slow)."""
    params = SamplingParams(max_tokens=3, temperature=0, logprobs=2, ignore_eos=True)
    with LLM(model, dtype="float32", attention_backend="triton", **SETTINGS) as llm:
        assert_invariant(llm, params, 2, seed=3, target=TARGET[:40], longest=24, most=2)


def test_lora_rows_are_batch_invariant_whatever_slot_and_neighbours(tmp_path):
    """The target on one adapter, the others on two more adapters or the base, with two slots: its adapter moves
    between slots as the others' come and go, and each row multiplies its own slot's A and B."""
    from tests.lora.adapters import ATTENTION, MLP, make_peft_adapter, write_tiny_base
    from tpengine.lora.request import LoRARequest
    base = write_tiny_base(str(tmp_path / "base"), seed=5)
    adapters = [LoRARequest(f"a{i}", i, make_peft_adapter(base, str(tmp_path / f"a{i}"), r=4 * i, alpha=8 * i,
                                                          targets=ATTENTION + MLP if i % 2 else ATTENTION, seed=i))
                for i in (1, 2, 3)] + [None]
    target = [(7 * i + 3) % 300 + 5 for i in range(150)]
    with LLM(base, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16, **SETTINGS) as llm:
        assert_invariant(llm, GREEDY, 6, seed=5, target=target, adapters=adapters, longest=60, most=5,
                         vocab=300)


MOE = dict(vocab_size=1003, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2)


@pytest.mark.parametrize("settings", [dict(architecture="Qwen3MoeForCausalLM", moe_intermediate_size=32),
                                      dict(architecture="GptOssForCausalLM", sliding_window=64,
                                           layer_types=["sliding_attention", "full_attention"])],
                         ids=["qwen3_moe", "gpt_oss"])
def test_mixtures_of_experts_are_batch_invariant(tmp_path, settings):
    """Each expert's rows in fixed tiles, a token's experts summed in expert order (gpt-oss: sinks, a window)."""
    path = write_tiny_model(str(tmp_path / "moe"), seed=3, **MOE, **settings)
    with LLM(path, dtype="float32", **SETTINGS) as llm:
        assert_invariant(llm, GREEDY, 6, seed=4)
