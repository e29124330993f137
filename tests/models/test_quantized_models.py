"""Quantized weights end to end: greedy tokens equal transformers' running the dequantized weights.

A quantized checkpoint (GPTQ, AWQ, compressed-tensors, written by tests/quantization/checkpoints.py as the
tools publish them), or a float checkpoint quantized at load (`quantization="int8" | "int4"`), is measured
against a float checkpoint whose every quantized tensor is replaced by the float value it stands for
(QuantizedWeight.dequantize), which transformers runs: the oracle. W8A8's oracle also quantizes each
quantized linear's input per token, as the engine does. At tensor-parallel size 1 and 2, block sizes 16 and
256, with chunked prefill and prefix-cache hits.
"""
import functools
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import hf_greedy, random_prompts
from tests.models.moe import moe_checkpoint
from tests.quantization.checkpoints import CheckpointFormat, write_quantized_and_reference
from tpengine import LLM, SamplingParams
from tpengine.platforms import cpu as cpu_platform
from tpengine.quantization.online import quantize_weight
from tpengine.quantization.weights import quantize_per_token

MAX_NEW_TOKENS = 10
# Quantizing a linear's input per token rounds each element to a step of max|x| / 127: a float difference of one
# ulp upstream (another summation order than transformers') moves an element across a rounding boundary now and
# then, and each such element moves the logits by up to a few hundredths here, so greedy paths may part at a
# near tie. Where inputs are quantized (W8A8, and the CPU's online int8/int4), the engine's tokens are rated by
# the oracle instead: within this many nats of its best at every step, with the log-probabilities agreeing.
INT8_INPUT_TOLERANCE = 0.1


def online_reference(src: str, dst: str, bits: int, group_size: int | None, lm_head: bool = True) -> str:
    """src's float checkpoint with every tensor the engine quantizes at load replaced by its dequantized value."""
    if not os.path.exists(os.path.join(dst, "config.json")):
        shutil.copytree(src, dst, dirs_exist_ok=True)
        for name in os.listdir(dst):
            if name.endswith(".safetensors"):
                tensors = load_file(os.path.join(dst, name))
                for key, tensor in tensors.items():
                    head = key.startswith("lm_head.") or "embed_tokens." in key
                    if tensor.dim() == 2 and ".mlp.gate." not in key and (lm_head or not head):
                        tensors[key] = quantize_weight(tensor.float(), bits, group_size, "float").dequantize()
                save_file(tensors, os.path.join(dst, name), metadata={"format": "pt"})
    return dst


def check_online(llm: LLM, reference: str, prompts: list[list[int]], tensor_parallel_size: int = 1,
                 lm_head: bool = True, chunked: bool = False) -> None:
    """The engine against transformers on the dequantized weights, each quantized linear's input quantized per
    token where the CPU does so for a checkpoint quantized at load."""
    def run(batch):
        return greedy_with_logprobs(llm, batch)
    results = run(prompts[:1]) + run(prompts[1:]) if chunked else run(prompts)  # the second hits the first's prefix
    if cpu_platform.ONLINE_QUANTIZATION_ACTIVATION == "float":
        assert [tokens for tokens, _ in results] == hf_greedy(reference, prompts, MAX_NEW_TOKENS)
        return
    quantized = lambda name: not name.endswith(".mlp.gate") and (lm_head or name != "lm_head")  # noqa: E731
    oracle = int8_input_oracle(reference, quantized, tensor_parallel_size)
    assert_near_oracle(oracle, prompts, results)


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    return [out.token_ids for out in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def prompts_with_shared_prefix(vocab_size: int) -> list[list[int]]:
    """Two prompts that share 40 tokens (a prefix-cache hit at block size 16), and two that share nothing."""
    first, second, third = random_prompts(7, [40, 9, 23], vocab_size)
    return [first + second, first + third, second, third]


@pytest.mark.parametrize("quantization,group_size", [("int8", None), ("int4", 32)])
def test_online_quantization_equals_transformers_on_the_dequantized_weights(tiny_model, tmp_path, quantization,
                                                                            group_size):
    bits = 8 if quantization == "int8" else 4
    reference = online_reference(tiny_model, str(tmp_path / "reference"), bits, group_size)
    # block 16 with 24-token chunks: prompts prefill in several chunks, and the second hits the first's prefix
    with LLM(tiny_model, quantization=quantization, quantization_group_size=group_size or 128,
             kvcache_block_size=16, max_num_batched_tokens=24) as llm:
        check_online(llm, reference, prompts_with_shared_prefix(1003), chunked=True)


def test_online_int4_at_tp2_and_block_256_with_a_tied_head(tied_model, tmp_path):
    """The tied embedding and LM head quantized (rows gathered dequantized), row-parallel groups per rank."""
    config = json.load(open(os.path.join(tied_model, "config.json")))
    assert config["tie_word_embeddings"]
    reference = online_reference(tied_model, str(tmp_path / "reference"), 4, 32)
    with LLM(tied_model, quantization="int4", quantization_group_size=32, tensor_parallel_size=2,
             kvcache_block_size=256) as llm:
        check_online(llm, reference, prompts_with_shared_prefix(config["vocab_size"]), tensor_parallel_size=2)


def test_online_quantization_can_leave_the_head_in_floats(tiny_model, tmp_path):
    reference = online_reference(tiny_model, str(tmp_path / "reference"), 8, None, lm_head=False)
    with LLM(tiny_model, quantization="int8", quantize_lm_head=False, kvcache_block_size=16) as llm:
        check_online(llm, reference, prompts_with_shared_prefix(1003), lm_head=False)


@pytest.mark.parametrize("settings,message", [
    (dict(quantization="int3"), "quantization must be one of"),
    (dict(quantization="int8", quantization_group_size=32), "applies to quantization='int4' only"),
    (dict(quantize_lm_head=False), "quantize_lm_head=False applies to quantization"),
    (dict(quantization="int4", quantization_group_size=48), "quantization_group_size=48 must divide the model's hidden_size=64"),
    # o_proj reads 192 features, 96 per rank at tp 2: a group of 64 would straddle the ranks
    (dict(quantization="int4", quantization_group_size=64, tensor_parallel_size=2),
     "quantization_group_size=64 must divide the model's num_attention_heads * head_dim=192, 96 per rank"),
])
def test_online_quantization_settings_that_cannot_work_are_refused_by_name(tiny_model, settings, message):
    with pytest.raises(ValueError, match=message.replace("*", r"\*")):
        LLM(tiny_model, **settings)


def int8_input_oracle(reference: str, quantized_modules, tensor_parallel_size: int = 1):
    """transformers on the dequantized weights with each quantized linear's input quantized per token first
    (W8A8), as each rank sees it: a row-parallel linear's (o_proj, down_proj) in tensor_parallel_size slices."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()

    def quantize_input(slices: int):
        def hook(module, args):
            parts = [quantize_per_token(part) for part in args[0].chunk(slices, dim=-1)]
            return (torch.cat([values.float() * scales for values, scales in parts], dim=-1),)
        return hook
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and quantized_modules(name):
            row_parallel = name.endswith(("o_proj", "down_proj"))
            module.register_forward_pre_hook(quantize_input(tensor_parallel_size if row_parallel else 1))
    return model


def greedy_with_logprobs(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, logprobs=0)
    outs = [out.outputs[0] for out in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    return [(out.token_ids, [step[token] for step, token in zip(out.logprobs, out.token_ids)]) for out in outs]


def assert_near_oracle(oracle, prompts: list[list[int]], results: list[tuple[list[int], list[float]]]) -> None:
    """Teacher-forced on the engine's own tokens, every step: the oracle rates the engine's greedy choice within
    INT8_INPUT_TOLERANCE of its own best, and gives it the log-probability the engine reported, within the same."""
    with torch.inference_mode():
        for prompt, (tokens, logprobs) in zip(prompts, results, strict=True):
            assert len(tokens) == MAX_NEW_TOKENS
            logits = oracle(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
            rated = torch.log_softmax(logits.float(), dim=-1)
            chosen = rated[torch.arange(len(tokens)), torch.tensor(tokens)]
            regret = float((rated.max(dim=-1).values - chosen).max())
            deviation = float((chosen - torch.tensor(logprobs)).abs().max())
            assert regret <= INT8_INPUT_TOLERANCE and deviation <= INT8_INPUT_TOLERANCE, (regret, deviation)


@functools.cache
def quantized_checkpoint(float_dir: str, fmt: CheckpointFormat, root: str) -> tuple[str, str, frozenset[str]]:
    """(quantized checkpoint, its float reference, the quantized modules), written once per format."""
    name = f"{fmt.method}-{fmt.bits}-{fmt.group_size}-{fmt.sym}-{fmt.desc_act}-{fmt.checkpoint_format}"
    quantized, reference = os.path.join(root, name), os.path.join(root, name + "-reference")
    written = write_quantized_and_reference(float_dir, quantized, reference, fmt)
    return quantized, reference, frozenset(written)


FORMATS = {
    "gptq-4bit-g32-act-order": CheckpointFormat("gptq", bits=4, group_size=32, desc_act=True),
    "gptq-8bit-channel-zero-points": CheckpointFormat("gptq", bits=8, group_size=None, sym=False),
    "awq-4bit-g32": CheckpointFormat("awq", bits=4, group_size=32),
    "compressed-tensors-w4a16-g32-zero-points": CheckpointFormat("pack-quantized", bits=4, group_size=32, sym=False),
    "compressed-tensors-w8a16-channel": CheckpointFormat("pack-quantized", bits=8, group_size=None),
    "compressed-tensors-w8a8": CheckpointFormat("int-quantized", bits=8, group_size=None),
    "compressed-tensors-fp8": CheckpointFormat("float-quantized", bits=8, group_size=None),
}


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS.keys())
def test_quantized_checkpoints_equal_transformers_on_their_dequantized_weights(tiny_model, tmp_path_factory, fmt):
    quantized, reference, modules = quantized_checkpoint(tiny_model, fmt, str(tmp_path_factory.mktemp("quantized")))
    prompts = prompts_with_shared_prefix(1003)
    with LLM(quantized, kvcache_block_size=16, max_num_batched_tokens=24) as llm:
        results = greedy_with_logprobs(llm, prompts[:1]) + greedy_with_logprobs(llm, prompts[1:])
    if fmt.method == "int-quantized":
        assert_near_oracle(int8_input_oracle(reference, modules.__contains__), prompts, results)
    else:
        assert [tokens for tokens, _ in results] == hf_greedy(reference, prompts, MAX_NEW_TOKENS)


def test_act_order_gptq_at_tp2_with_block_256(tiny_model, tmp_path_factory):
    """Row-parallel act order: each rank sorts its own columns by group and pads the groups it holds in part."""
    fmt = FORMATS["gptq-4bit-g32-act-order"]
    quantized, reference, _ = quantized_checkpoint(tiny_model, fmt, str(tmp_path_factory.mktemp("quantized")))
    prompts = prompts_with_shared_prefix(1003)
    with LLM(quantized, tensor_parallel_size=2, kvcache_block_size=256) as llm:
        assert greedy(llm, prompts) == hf_greedy(reference, prompts, MAX_NEW_TOKENS)


def test_quantized_moe_experts_at_tp2(tmp_path_factory):
    fmt = CheckpointFormat("gptq", bits=4, group_size=16)
    quantized, reference, modules = quantized_checkpoint(moe_checkpoint(), fmt,
                                                         str(tmp_path_factory.mktemp("quantized_moe")))
    assert any(".experts." in module for module in modules)
    prompts = prompts_with_shared_prefix(1003)
    with LLM(quantized, tensor_parallel_size=2, kvcache_block_size=16) as llm:
        assert greedy(llm, prompts) == hf_greedy(reference, prompts, MAX_NEW_TOKENS)


def test_a_tp_that_splits_a_checkpoint_group_is_refused_naming_both(tiny_model, tmp_path_factory):
    """o_proj reads 192 features, 96 per rank at tp 2: groups of 64 would straddle the ranks."""
    fmt = CheckpointFormat("gptq", bits=4, group_size=64)
    quantized, _, _ = quantized_checkpoint(tiny_model, fmt, str(tmp_path_factory.mktemp("quantized")))
    with pytest.raises(ValueError, match="tensor parallel size 2 splits a quantization group.*group size 64"):
        LLM(quantized, tensor_parallel_size=2)
