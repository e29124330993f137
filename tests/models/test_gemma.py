"""Gemma 2 and Gemma 3 give transformers' greedy tokens and soft-capped logprobs: tp 1, 2 and 4, block sizes 16 and
256, chunked prefill, prefix hits and preemption, with prompts and outputs past the sliding window, on the torch,
cpu and (interpreted) Triton backends; a Gemma3ForConditionalGeneration checkpoint serves its text model."""
import functools
import glob
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import random_prompts
from tests.leftovers import session_folder
from tests.models.parity import GREEDY, assert_parity, check_preemption, check_twice_with_prefix_hits
from tpengine import LLM, SamplingParams
from tpengine.hf_config import check_supported, parse_hf_config
from tpengine.tiny_model import write_tiny_model

WINDOW = 32
SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=1024, initializer_range=0.1, vocab_size=1003, sliding_window=WINDOW,
             query_pre_attn_scalar=24)  # a scale of 24 ** -0.5, not head_dim's 16 ** -0.5
# Gemma 3's 4B-and-up rope: linear scaling on the full layers, a base of 10k on the sliding ones
GEMMA3_ROPE = {"full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1e6),
               "sliding_attention": dict(rope_type="default", rope_theta=1e4)}
MODELS = {
    # sliding, full, sliding, full; caps small enough to bend scores and logits (Gemma 2's are 50 and 30)
    "gemma2": dict(architecture="Gemma2ForCausalLM", num_hidden_layers=4, attn_logit_softcapping=1.0,
                   final_logit_softcapping=1.5, **SMALL),
    # sliding, sliding, full (sliding_window_pattern 3); q/k norms; a capped head
    "gemma3": dict(architecture="Gemma3ForCausalLM", num_hidden_layers=3, sliding_window_pattern=3,
                   rope_parameters=GEMMA3_ROPE, final_logit_softcapping=1.5, **SMALL),
}
PROMPT_LENGTHS = [1, WINDOW, WINDOW + 1, 100]  # fill the window, end one past it, run several windows past it


def randomize_norms(path: str, seed: int) -> None:
    """transformers starts Gemma's norm weights at 0 (a scale of 1): draw them, so 1 + weight counts."""
    g = torch.Generator().manual_seed(seed)
    for file in glob.glob(os.path.join(path, "*.safetensors")):
        tensors = load_file(file)
        for name, tensor in tensors.items():
            if "norm" in name:
                tensors[name] = torch.randn(tensor.shape, generator=g) * 0.5
        save_file(tensors, file, metadata={"format": "pt"})


@functools.lru_cache(maxsize=None)
def gemma_checkpoint(name: str) -> str:
    path = write_tiny_model(os.path.join(_session_dir(), name), seed=len(name), with_tokenizer=False, **MODELS[name])
    randomize_norms(path, len(name))
    return path


@functools.lru_cache(maxsize=None)
def conditional_checkpoint(layout: str) -> str:
    """A Gemma3ForConditionalGeneration with a tiny SigLIP tower, the text model gemma3's shape, saved as
    transformers 5 saves it ("v5": model.language_model.*), or renamed as transformers 4 saved it
    ("v4": language_model.model.*, vision_tower.*)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    text = {k: v for k, v in MODELS["gemma3"].items() if k != "architecture"}
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    # a cap transformers' Gemma3ForConditionalGeneration does not apply
    config = Gemma3Config(text_config=text, vision_config=vision.to_dict(), mm_tokens_per_image=4,
                          boi_token_index=1000, eoi_token_index=1001, image_token_index=1002)
    torch.manual_seed(7)
    model = Gemma3ForConditionalGeneration(config).to(torch.float32)
    path = os.path.join(_session_dir(), f"gemma3_conditional_{layout}")
    model.save_pretrained(path, safe_serialization=True)
    randomize_norms(path, 7)
    if layout == "v4":
        renames = [("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."),
                   ("model.vision_tower.", "vision_tower."), ("model.multi_modal_projector.", "multi_modal_projector.")]
        for file in glob.glob(os.path.join(path, "*.safetensors")):
            tensors = load_file(file)
            renamed = {}
            for name, tensor in tensors.items():
                for old, new in renames:
                    if name.startswith(old):
                        name = new + name.removeprefix(old)
                        break
                renamed[name] = tensor
            save_file(renamed, file, metadata={"format": "pt"})
    return path


@functools.lru_cache(maxsize=None)
def _session_dir() -> str:
    return session_folder(prefix="tpengine-gemma-")


CASES = [
    ("gemma2", 1, 16, "torch"), ("gemma2", 1, 256, "auto"), ("gemma2", 4, 16, "auto"),  # tp 4: KV heads replicated
    ("gemma3", 1, 16, "auto"), ("gemma3", 1, 256, "torch"), ("gemma3", 2, 256, "auto"),
]


@pytest.mark.parametrize("name, tp, block_size, backend", CASES, ids=lambda v: str(v))
def test_greedy_matches_transformers_with_chunked_prefill_and_prefix_hits(name, tp, block_size, backend):
    # 48: the 100-token prompt prefills in chunks
    check_twice_with_prefix_hits(gemma_checkpoint(name), random_prompts(len(name), PROMPT_LENGTHS, 1000),
                                 tensor_parallel_size=tp, kvcache_block_size=block_size, attention_backend=backend,
                                 max_num_batched_tokens=48)


def test_preemption_under_a_small_cache_still_matches():  # the scheduler's part is the same for every family
    # each request needs 3-5 blocks of 16; 8 blocks hold two at a time; outputs run past the window
    check_preemption(gemma_checkpoint("gemma3"), random_prompts(5, [30, 31, 29, 40, 18], 1000), max_tokens=30)


def test_triton_backend_matches_transformers_past_the_window():
    pytest.importorskip("triton")
    path = gemma_checkpoint("gemma2")  # soft-capped scores in the kernels
    prompts = random_prompts(6, [3, WINDOW + 5], 1000)  # the interpreter is slow
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with LLM(path, kvcache_block_size=16, attention_backend="triton") as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_parity(path, prompts, outputs, 4)


def hf_first_logprobs(path: str, prompt: list[int]) -> torch.Tensor:
    from tests.conftest import _hf_model
    with torch.inference_mode():
        logits = _hf_model(path)(torch.tensor([prompt])).logits[0, -1]
    return logits.float().log_softmax(-1)


@pytest.mark.parametrize("path_of", [lambda: gemma_checkpoint("gemma2"), lambda: gemma_checkpoint("gemma3"),
                                     lambda: conditional_checkpoint("v5")], ids=["gemma2", "gemma3", "conditional"])
def test_logprobs_match_transformers_soft_capped_logits(path_of):
    """Greedy tokens cannot see the final cap (tanh keeps the order); logprobs can. Gemma3ForConditionalGeneration
    caps none, though its text config sets a cap, as transformers computes it."""
    path = path_of()
    prompt = random_prompts(9, [WINDOW + 3], 1000)[0]
    with LLM(path, kvcache_block_size=16) as llm:
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, logprobs=5), use_tqdm=False)[0]
    ours = out.outputs[0].logprobs[0]
    expected = hf_first_logprobs(path, prompt)
    for token, logprob in ours.items():
        assert logprob == pytest.approx(expected[token].item(), abs=1e-4)


@pytest.mark.parametrize("layout", ["v5", "v4"])
def test_a_conditional_generation_checkpoint_serves_its_text_model(layout):
    path = conditional_checkpoint(layout)
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["architectures"] == ["Gemma3ForConditionalGeneration"]
    prompts = random_prompts(11, [5, WINDOW + 9], 1000)
    with LLM(path, kvcache_block_size=16, max_num_batched_tokens=24) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_parity(path, prompts, outputs, oracle=conditional_checkpoint("v5"))  # transformers reads v5's names


@pytest.mark.parametrize("settings, message", [
    (dict(model_type="gemma2", hidden_activation="gelu"), "hidden_activation='gelu' is not supported"),
    (dict(model_type="gemma3_text", hidden_activation="gelu_new"), "hidden_activation='gelu_new' is not supported"),
    (dict(model_type="gemma3_text", use_bidirectional_attention=True), "use_bidirectional_attention=True is not"),
    (dict(model_type="gemma2", use_bidirectional_attention=True), "use_bidirectional_attention=True is not"),
    (dict(model_type="gemma3_text", rope_scaling=dict(rope_type="dynamic", factor=2.0)),
     "rope type 'dynamic' is not supported"),
    (dict(model_type="gemma3", text_config=dict(rope_parameters={
        "full_attention": dict(rope_type="dynamic", factor=4.0), "sliding_attention": dict(rope_type="default")})),
     "rope type 'dynamic' is not supported"),
])
def test_unsupported_gemma_settings_are_a_value_error_naming_them(settings, message):
    config = parse_hf_config({"architectures": ["Gemma2ForCausalLM"], **settings}, "config.json")
    with pytest.raises(ValueError, match=message):
        check_supported(config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_rms_norm_matches_transformers_with_and_without_a_residual(dtype):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from tpengine.layers.layernorm import GemmaRMSNorm
    g = torch.Generator().manual_seed(0)
    theirs = Gemma3RMSNorm(64, eps=1e-6)
    theirs.weight.data = (torch.randn(64, generator=g) * 0.5).to(dtype)
    ours = GemmaRMSNorm(64, eps=1e-6)
    ours.weight.load_state.weight_loader(ours.weight, theirs.weight.data)
    x, residual = (torch.randn(5, 64, generator=g).to(dtype) for _ in range(2))
    # float32 runs the platform's op (the CPU's C++ sums in another order); bfloat16 the torch code, bit for bit
    same = torch.testing.assert_close if dtype == torch.float32 else \
        lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0)
    with torch.no_grad():
        same(ours(x.clone()), theirs(x))
        normed, summed = ours(x.clone(), residual.clone())
        same(summed, x + residual)
        same(normed, theirs(x + residual))


def test_gemma_q_k_norms_run_before_the_rotation_in_bfloat16():
    """The CPU's fused q/k norm takes weights of q's dtype; Gemma's float32 ones take the torch path."""
    from tpengine.hf_config import RopeParameters
    from tpengine.layers.layernorm import GemmaRMSNorm
    from tpengine.layers.rotary_embedding import RotaryEmbedding
    from tpengine.platforms import torch_ops
    g = torch.Generator().manual_seed(1)
    norm = GemmaRMSNorm(16)
    norm.weight.load_state.weight_loader(norm.weight, torch.randn(16, generator=g))
    rope = RotaryEmbedding(16, 64, RopeParameters(theta=1e4))
    q, k = torch.randn(3, 4, 16, generator=g).bfloat16(), torch.randn(3, 2, 16, generator=g).bfloat16()
    positions = torch.tensor([0, 5, 9])
    expected = torch_ops.apply_rotary_in_halves(positions, norm(q), norm(k), rope.cos_sin_cache)
    for ours, ref in zip(rope(positions, q.clone(), k.clone(), norm, norm), expected, strict=True):
        assert torch.equal(ours, ref)
