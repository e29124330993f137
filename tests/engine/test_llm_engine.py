"""Greedy token ids equal transformers' at tp=1, across block sizes, chunking, prefix hits and preemption."""
import pytest
from transformers import AutoTokenizer

from tests.conftest import TP_MODEL, hf_greedy, random_prompts
from tpengine import LLM, SamplingParams
from tpengine.attention import triton_problem
from tpengine.kernels.cpu.build import has_compiler

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
VOCAB = TP_MODEL["vocab_size"]


def expected_auto_backend(runner) -> str | None:
    """What 'auto' picks for this engine (the README's rules), or None where it depends on the machine."""
    if runner.device.type == "cuda":
        # this checkpoint is float32, which flash-attn cannot run: Triton where it is usable
        return "triton" if triton_problem(runner.device) is None else "torch"
    return "cpu" if has_compiler() else None


def assert_parity(path, prompts, outputs, max_tokens=GREEDY.max_tokens):
    expected = hf_greedy(path, prompts, max_tokens)
    for i, (out, ref) in enumerate(zip(outputs, expected, strict=True)):
        assert out.token_ids == ref, f"prompt {i} (len {len(prompts[i])}) diverges from transformers"
        assert out.prompt_token_ids == prompts[i]


@pytest.mark.parametrize("backend", ["auto", "torch"])  # auto is the C++ decode kernel; torch, the reference
@pytest.mark.parametrize("block_size", [16, 256])
def test_greedy_matches_transformers_for_prompts_around_a_block(tiny_model, block_size, backend):
    lengths = [1, block_size - 3, block_size, block_size + 5, 2 * block_size + 1]
    prompts = random_prompts(block_size, lengths, VOCAB)
    with LLM(tiny_model, kvcache_block_size=block_size, attention_backend=backend) as llm:
        if backend == "auto" and expected_auto_backend(llm.executor.runner) is not None:
            assert llm.executor.runner.backend_name == expected_auto_backend(llm.executor.runner)
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_parity(tiny_model, prompts, outputs)
    assert all(o.finish_reason == "length" and len(o.token_ids) == GREEDY.max_tokens for o in outputs)


@pytest.mark.parametrize("block_size", [16, 256])
def test_chunked_prefill_matches_transformers(tiny_model, block_size):
    prompts = random_prompts(7, [300, 45, 130, 2], VOCAB)
    with LLM(tiny_model, kvcache_block_size=block_size, max_num_batched_tokens=64) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_parity(tiny_model, prompts, outputs)


@pytest.mark.parametrize("block_size", [16, 256])
def test_second_pass_hits_prefix_cache_and_still_matches(tiny_model, block_size):
    prompts = random_prompts(11, [40, 2 * block_size + 7, block_size], VOCAB)
    with LLM(tiny_model, kvcache_block_size=block_size) as llm:
        first = llm.generate(prompts, GREEDY, use_tqdm=False)
        second = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_parity(tiny_model, prompts, first)
    assert_parity(tiny_model, prompts, second)
    assert [o.num_cached_tokens for o in first] == [0, 0, 0]
    # exact reuse: all but the last token, computed for its logits (the seed's whole blocks gave
    # ((n - 1) // block_size) * block_size)
    assert [o.num_cached_tokens for o in second] == [n - 1 for n in (40, 2 * block_size + 7, block_size)]


def test_shared_long_prefix_is_reused_and_matches(tiny_model):
    prefix = random_prompts(3, [100], VOCAB)[0]
    prompts = [prefix + tail for tail in random_prompts(4, [5, 17, 33], VOCAB)]
    with LLM(tiny_model, kvcache_block_size=16) as llm:
        llm.generate([prompts[0]], GREEDY, use_tqdm=False)
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_parity(tiny_model, prompts, outputs)
    # exact reuse: the repeat all but its last token, the others the 100 shared tokens (the seed's whole
    # blocks gave 96 each)
    assert [o.num_cached_tokens for o in outputs] == [104, 100, 100]


def test_preemption_under_a_small_cache_still_matches(tiny_model):
    prompts = random_prompts(5, [30, 31, 29, 40, 18, 25], VOCAB)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=8) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.scheduler.num_preemptions > 0
        assert llm.scheduler.block_manager.num_free_blocks == 8
    assert_parity(tiny_model, prompts, outputs, max_tokens=40)


def test_tied_embeddings_and_text_prompts_match(tied_model):
    texts = ["Hello, world", "tensor parallel"]
    with LLM(tied_model, kvcache_block_size=16) as llm:
        outputs = llm.generate(texts, GREEDY, use_tqdm=False)
    tokenizer = AutoTokenizer.from_pretrained(tied_model)  # transformers' own, not the engine's instance
    prompts = [tokenizer.encode(text) for text in texts]
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert [o.text for o in outputs] == [tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in outputs]
    assert_parity(tied_model, prompts, outputs)


@pytest.mark.parametrize("budget", [7, 64])
def test_small_token_budgets_splitting_prompts_still_match(tiny_model, budget):
    # one budget bounds every forward (2048 tokens by default on the CPU, 16384 on CUDA); small ones
    # split prompts across steps next to decodes, before and after a prefix hit
    prompts = random_prompts(13, [1, 30, 150, 64, 9], VOCAB)
    with LLM(tiny_model, kvcache_block_size=16) as llm:
        runner = llm.executor.runner
        assert runner.max_num_batched_tokens == (2048 if runner.device.type == "cpu" else 16384)
    with LLM(tiny_model, kvcache_block_size=16, max_num_batched_tokens=budget) as llm:
        first = llm.generate(prompts, GREEDY, use_tqdm=False)
        second = llm.generate([p + [5, 6, 7] for p in prompts], GREEDY, use_tqdm=False)
    assert_parity(tiny_model, prompts, first)
    assert_parity(tiny_model, [p + [5, 6, 7] for p in prompts], second)
    # exact reuse: each whole first prompt, copied past its last whole block (the seed's whole blocks
    # gave [0, 16, 144, 64, 0])
    assert [o.num_cached_tokens for o in second] == [1, 30, 150, 64, 9]
