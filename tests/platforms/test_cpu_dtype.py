"""Half precision on the CPU: bfloat16 runs natively where the CPU has the instructions and agrees with
transformers in bfloat16; a half dtype the CPU cannot compute fast runs as float32, exactly transformers'
float32 greedy tokens, with one log line; a bfloat16 model there keeps its linear weights in bfloat16 where
the CPU has AVX2."""
import functools
import logging
import os

import pytest
import torch

from tests.conftest import TP_MODEL, hf_greedy, random_prompts
from tests.runner.test_cpu_replay import count_replayed_rows
from tpengine import LLM, SamplingParams
from tpengine.kernels.cpu import bf16_linear as bf16_kernel
from tpengine.kernels.cpu.build import cpu_flags
from tpengine.platforms import cpu, cpu_dtype
from tpengine.platforms.cpu_dtype import half_precision_problem, resolve_cpu_dtype
from tpengine.tiny_model import write_tiny_model

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = random_prompts(15, [1, 7, 20, 33, 50, 64, 90, 130, 200, 260, 5, 12, 40, 77, 150, 300], TP_MODEL["vocab_size"])
LOGPROB_TOLERANCE = 0.05  # bfloat16 keeps 8 bits of mantissa: ~0.4% per rounding, over a few layers
bf16_natively = pytest.mark.skipif(resolve_cpu_dtype(torch.bfloat16, log=False) != torch.bfloat16,
                                   reason="this CPU has no fast bfloat16 kernels")


def test_bfloat16_is_native_only_with_its_instructions_and_onednn():
    assert half_precision_problem(torch.bfloat16, frozenset({"avx512f", "avx512_bf16"}), True, "x86_64") is None
    assert half_precision_problem(torch.bfloat16, frozenset({"amx_bf16"}), True, "x86_64") is None
    assert "avx512_bf16" in half_precision_problem(torch.bfloat16, frozenset({"avx512f"}), True, "x86_64")
    assert "oneDNN" in half_precision_problem(torch.bfloat16, frozenset({"avx512_bf16"}), False, "x86_64")


def test_float16_needs_fp16_instructions_not_bf16_ones():
    assert "avx512_fp16" in half_precision_problem(torch.float16, frozenset({"avx512_bf16"}), True, "x86_64")
    assert half_precision_problem(torch.float16, frozenset({"avx512_fp16"}), True, "x86_64") is None


def test_float32_and_auto_stay_float32_on_the_cpu():
    assert resolve_cpu_dtype(torch.float32) == torch.float32


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_dtype_without_its_instructions_runs_as_float32_with_transformers_float32_tokens(
        tiny_model, dtype, monkeypatch, caplog):
    monkeypatch.setattr(cpu_dtype, "cpu_flags", lambda: frozenset())  # as on a CPU with no half instructions
    monkeypatch.setattr(cpu_dtype, "onednn_supports", lambda dtype: False)
    prompts = PROMPTS[:6]
    with caplog.at_level(logging.INFO, logger="tpengine"):
        with LLM(tiny_model, dtype=dtype, kvcache_block_size=16) as llm:
            runner = llm.executor.runner
            assert runner.dtype == torch.float32 and runner.kv_cache.dtype == torch.float32
            outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [line for line in caplog.messages if f"dtype {dtype} runs as float32 on this CPU" in line]
    assert [o.token_ids for o in outputs] == hf_greedy(tiny_model, prompts, MAX_TOKENS)


@functools.cache
def _hf_bfloat16(path: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()


def hf_bfloat16_greedy(path: str, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens in bfloat16, and its logits of the first generated position."""
    model = _hf_bfloat16(path)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long), eos_token_id=None,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), out.logits[0][0].float()


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


@bf16_natively
@pytest.mark.parametrize("tp", [1, 2])  # tp 2: sharded packed weights, bfloat16 partial sums all-reduced
def test_bfloat16_runs_on_packed_bf16_weights_and_agrees_with_transformers_in_bfloat16(tiny_model, tp):
    with LLM(tiny_model, dtype="bfloat16", kvcache_block_size=16, tensor_parallel_size=tp) as llm:
        runner = llm.executor.runner
        assert runner.dtype == torch.bfloat16 and runner.kv_cache.dtype == torch.bfloat16
        packed = [m for m in runner.model.modules() if getattr(m, "packed_weight", None) is not None]
        assert len(packed) == 4 * TP_MODEL["num_hidden_layers"] + 1  # qkv, o, gate_up, down per layer, the head
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        first = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=1, logprobs=5), use_tqdm=False)
    references = [hf_bfloat16_greedy(tiny_model, p) for p in PROMPTS]
    divergences = [first_divergence(o.token_ids, ref) for o, (ref, _) in zip(outputs, references)]
    # bfloat16 rounds differently in every kernel, and this tiny model's top logits lie close together:
    # measured 9 of 16 prompts match transformers' bfloat16 tokens fully (docs/benchmarks.md)
    assert sum(d is None for d in divergences) >= len(PROMPTS) // 2, divergences
    # ... and bfloat16 costs us no more agreement with the float32 oracle than it costs transformers
    float32 = hf_greedy(tiny_model, PROMPTS, MAX_TOKENS)
    ours_exact = sum(o.token_ids == ref for o, ref in zip(outputs, float32))
    theirs_exact = sum(ref == ref32 for (ref, _), ref32 in zip(references, float32))
    assert ours_exact >= theirs_exact, (ours_exact, theirs_exact)
    # the supplement: the first position's top log-probabilities lie close to transformers' bfloat16 ones
    for o, (_, logits) in zip(first, references):
        ref = torch.log_softmax(logits, dim=-1)
        top = o.outputs[0].logprobs[0]
        gap = max(abs(logprob - ref[token].item()) for token, logprob in top.items())
        assert gap < LOGPROB_TOLERANCE, (top, {t: ref[t].item() for t in top})


def _bf16_checkpoint(tmp_path_factory, name: str, **overrides) -> str:
    """A tiny checkpoint saved in bfloat16, as published ones are: transformers' float32 reading of it is exact."""
    from safetensors.torch import load_file, save_file
    path = write_tiny_model(str(tmp_path_factory.mktemp(name)), seed=3, **{**TP_MODEL, **overrides})
    weights = os.path.join(path, "model.safetensors")
    save_file({key: value.bfloat16() for key, value in load_file(weights).items()}, weights, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def bf16_checkpoints(tmp_path_factory) -> dict[str, str]:
    return {"untied": _bf16_checkpoint(tmp_path_factory, "bf16_untied"),
            "tied": _bf16_checkpoint(tmp_path_factory, "bf16_tied", tie_word_embeddings=True),
            # a hidden size of 63: the packing pairs inputs, so the linears that take the hidden states (and the
            # tables) run on float32 weights; o_proj and down_proj still on bfloat16 ones
            "odd": _bf16_checkpoint(tmp_path_factory, "bf16_odd", hidden_size=63)}


def without_bf16_instructions() -> frozenset[str]:
    return cpu_flags() - set(cpu_dtype.NATIVE_FLAGS[torch.bfloat16])


needs_bf16_weights_kernel = pytest.mark.skipif(
    not {"avx2", "fma"} <= cpu_flags() or not bf16_kernel.float_rows_available(),
    reason="no AVX2 and FMA (or no C++ compiler): a bfloat16 model's weights run as float32 here")


@needs_bf16_weights_kernel
@pytest.mark.parametrize("tied", ["untied", "tied", "odd"])
@pytest.mark.parametrize("tp", [1, 2])
def test_bfloat16_without_its_instructions_keeps_bfloat16_weights_with_transformers_float32_tokens(
        bf16_checkpoints, tied, tp, monkeypatch, caplog):
    """A bfloat16 model on a CPU without AVX512-BF16 runs in float32 with its linear weights and embedding table kept
    in bfloat16: the same numbers as transformers' float32 on the checkpoint's bfloat16 weights, half the bytes."""
    if tp == 1:  # as on an AVX2 CPU: the same process builds the model
        monkeypatch.setattr(cpu_dtype, "cpu_flags", without_bf16_instructions)
        monkeypatch.setattr(cpu_dtype, "onednn_supports", lambda dtype: False)
    elif resolve_cpu_dtype(torch.bfloat16, log=False) == torch.bfloat16:
        pytest.skip("the ranks' processes see this CPU's AVX512-BF16: bfloat16 runs natively there")
    path = bf16_checkpoints[tied]
    # chunked prefills (48 tokens a step), prefix hits (PROMPTS[:3] again) and blocks of 16
    prompts = PROMPTS[:8] + PROMPTS[:3]
    with caplog.at_level(logging.INFO, logger="tpengine"):
        with LLM(path, dtype="bfloat16", kvcache_block_size=16, tensor_parallel_size=tp, max_num_batched_tokens=48,
                 max_num_seqs=4) as llm:
            runner = llm.executor.runner
            assert runner.dtype == torch.float32 and runner.kv_cache.dtype == torch.float32
            assert runner.weight_dtype == torch.bfloat16
            model = runner.model
            linears = [m for m in model.modules() if hasattr(m, "packed_weight")]
            odd = [m for m in linears if type(m.packed_weight) is not cpu.Bf16Blocks]
            # qkv and gate_up in every layer, and the LM head: in float32
            assert len(odd) == (2 * TP_MODEL["num_hidden_layers"] + 1 if tied == "odd" else 0)
            assert all(m.packed_weight.dtype == torch.float32 and m.weight.dtype == torch.float32 for m in odd)
            linears = [m for m in linears if m not in odd]
            assert linears and all(type(m.packed_weight) is cpu.Bf16Blocks for m in linears)
            assert all(m.packed_weight.blocks.dtype == torch.bfloat16 and m.weight.numel() == 0 for m in linears)
            embedding = model.model.embed_tokens
            if tied == "odd":  # gathered from its float32 table
                assert embedding.packed_rows is None and embedding.weight.dtype == torch.float32
            else:
                assert type(embedding.packed_rows) is cpu.Bf16Blocks and embedding.weight.numel() == 0
            if tied == "tied":  # one packed table for both
                assert embedding.packed_rows is model.lm_head.packed_weight
            replayed = count_replayed_rows(runner)
            outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
            logits = llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=1, logprobs=3),
                                  use_tqdm=False)
    assert replayed, "the decode steps ran eagerly: the packed table's lookups must replay"
    if tp == 1:
        assert [line for line in caplog.messages if "its linear weights stay bfloat16" in line]
    assert [o.token_ids for o in outputs] == hf_greedy(path, prompts, MAX_TOKENS)
    for o, prompt in zip(logits, prompts[:2]):  # the supplement: float32 log-probabilities, to float32's tolerance
        ref = torch.log_softmax(_hf_float32_logits(path, prompt), dim=-1)
        for token, logprob in o.outputs[0].logprobs[0].items():
            assert abs(logprob - ref[token].item()) < 1e-4


def _hf_float32_logits(path: str, prompt: list[int]) -> torch.Tensor:
    from tests.conftest import _hf_model
    with torch.inference_mode():
        return _hf_model(path)(torch.tensor([prompt])).logits[0, -1].float()
