"""gpt-oss gives transformers' greedy tokens (sinks, a window shorter than the prompts, YaRN, biased experts with
the clamped SwiGLU) at tp 1, 2 and 4, both block sizes, chunked prefill, prefix hits and preemption, on the torch,
cpu and (interpreted) Triton backends; it routes as transformers does; an MXFP4 checkpoint dequantizes as
transformers dequantizes it and gives transformers' tokens."""
import pytest
import torch
from transformers import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

from tests.conftest import hf_greedy, random_prompts
from tests.models.parity import GREEDY, assert_parity, check_preemption, check_twice_with_prefix_hits
from tests.models.gpt_oss import GPT_OSS_MODEL, WINDOW, gpt_oss_checkpoint, mxfp4_checkpoint, quantize_mxfp4
from tpengine import LLM
from tpengine.layers.fused_moe import select_experts
from tpengine.quantization.mxfp4 import dequantize_mxfp4

CONFIG = {k: v for k, v in GPT_OSS_MODEL.items() if k not in ("architecture", "with_tokenizer")}
VOCAB = GPT_OSS_MODEL["vocab_size"]
# one token, the window filled, one past it, and several windows past it (and past YaRN's 64-token original window)
PROMPT_LENGTHS = [1, WINDOW, WINDOW + 1, 100]


# tp 4: one query head and a replicated KV head per rank, a quarter of every expert
@pytest.mark.parametrize("tp, block_size, backend", [(1, 16, "torch"), (1, 256, "auto"), (2, 16, "auto"),
                                                     (4, 256, "torch")])
def test_greedy_matches_transformers_with_chunked_prefill_and_prefix_hits(tp, block_size, backend):
    # 48: the longest prompt prefills in chunks
    check_twice_with_prefix_hits(gpt_oss_checkpoint(), random_prompts(29, PROMPT_LENGTHS, VOCAB),
                                 tensor_parallel_size=tp, kvcache_block_size=block_size, attention_backend=backend,
                                 max_num_batched_tokens=48)


def test_preemption_under_a_small_cache_still_matches():
    check_preemption(gpt_oss_checkpoint(), random_prompts(5, [30, 31, 29, 40, 18], VOCAB), max_tokens=24)  # past the window


def test_triton_backend_matches_transformers_with_a_prefix_hit():
    pytest.importorskip("triton")
    prompts = random_prompts(6, [3, WINDOW + 5], VOCAB)  # the interpreter is slow
    check_twice_with_prefix_hits(gpt_oss_checkpoint(), prompts, 4, kvcache_block_size=16, attention_backend="triton")


def test_routing_keeps_the_top_logits_and_softmaxes_them_as_transformers_does():
    # transformers' router over an identity weight and no bias sees exactly these logits
    config = GptOssConfig(**{**CONFIG, "hidden_size": 8, "num_local_experts": 8, "num_experts_per_tok": 3})
    router = GptOssTopKRouter(config)
    router.weight.data, router.bias.data = torch.eye(8), torch.zeros(8)
    logits = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    logits[0] = 1.0                               # every expert ties
    logits[1, [2, 5, 7]] = logits[1].max() + 1    # a three-way tie at the top
    logits[2, [6, 0]] = logits[2].max() + 1       # a tie for first, then the rest
    _, expected_weights, expected_ids = router(logits)
    weights, ids = select_experts(logits, 3, renormalize=False, softmax_after_top_k=True)
    assert torch.equal(ids, expected_ids) and torch.equal(weights, expected_weights)


def test_mxfp4_dequantizes_as_transformers_does():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(3, 64, 96, generator=g) * torch.logspace(-3, 2, 96)  # [experts, in, out], scales apart
    weight[0, :32, 0] = 0.0                                                   # a group of zeros
    blocks, scales = quantize_mxfp4(weight)
    assert blocks.shape == (3, 96, 2, 16) and scales.shape == (3, 96, 2)
    ours = dequantize_mxfp4(blocks, scales)
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    # the encoder's rounding stays within half FP4's widest step (4 to 6), its scale putting each group's largest
    # value in (3, 6]
    error = (ours - weight).abs().transpose(1, 2).reshape(3, 96, 2, 32).amax(-1)
    largest = weight.abs().transpose(1, 2).reshape(3, 96, 2, 32).amax(-1)
    assert bool((error <= largest / 3).all())
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(ours)), ours)  # FP4 values encode exactly


def test_mxfp4_blocks_and_scales_that_do_not_match_are_a_value_error():
    blocks, scales = quantize_mxfp4(torch.randn(2, 64, 8))
    with pytest.raises(ValueError, match=r"blocks \[2, 8, 2, 16\] and scales \[2, 8, 1\] do not match"):
        dequantize_mxfp4(blocks, scales[..., :1])
    with pytest.raises(ValueError, match="must be uint8"):
        dequantize_mxfp4(blocks.to(torch.int32), scales)


@pytest.mark.parametrize("tp", [1, 2])
def test_mxfp4_checkpoint_gives_transformers_tokens_on_its_dequantized_weights(tp):
    path = mxfp4_checkpoint()
    prompts = random_prompts(31, [5, 40], VOCAB)
    with LLM(path, tensor_parallel_size=tp, kvcache_block_size=16) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_parity(path, prompts, outputs)  # transformers dequantizes MXFP4 on the CPU, here to float32
    assert [o.token_ids for o in outputs] != hf_greedy(gpt_oss_checkpoint(), prompts, GREEDY.max_tokens)


def test_tp_must_divide_the_experts_intermediate_size(tmp_path):
    config = GptOssConfig(architectures=["GptOssForCausalLM"], **{**CONFIG, "intermediate_size": 33})
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 must divide the model's intermediate_size=33"):
        LLM(str(tmp_path), tensor_parallel_size=2)


def test_quantizing_at_load_is_refused_rather_than_leaving_the_experts_float():
    with pytest.raises(ValueError, match="quantization='int8' is not supported for gpt_oss"):
        LLM(gpt_oss_checkpoint(), quantization="int8")


def test_an_mxfp4_setting_tpengine_does_not_read_is_refused_by_name():
    from tpengine.hf_config import check_supported, parse_hf_config
    config = GptOssConfig(architectures=["GptOssForCausalLM"], **CONFIG).to_dict()
    config["quantization_config"] = {"quant_method": "mxfp4", "block_size": 64}
    with pytest.raises(ValueError, match=r"mxfp4 quantization_config keys \['block_size'\] are not supported"):
        check_supported(parse_hf_config(config, "config.json"))
