"""Qwen3-MoE gives transformers' greedy tokens at tp 1 and 2, and routes exactly as transformers does."""
import pytest
import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from tests.conftest import as_hf_config, hf_greedy, random_prompts
from tests.models.moe import MOE_MODEL, moe_checkpoint
from tpengine import LLM, SamplingParams
from tpengine.layers.fused_moe import select_experts

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
CONFIG = {k: v for k, v in MOE_MODEL.items() if k not in ("architecture", "with_tokenizer")}


@pytest.mark.parametrize("tp, block_size", [(1, 16), (1, 256), (2, 16), (2, 256)])
def test_greedy_matches_transformers_with_chunked_prefill_and_prefix_hits(tp, block_size):
    path = moe_checkpoint()
    prompts = random_prompts(17, [1, 20, 100, 260], MOE_MODEL["vocab_size"])
    with LLM(path, tensor_parallel_size=tp, kvcache_block_size=block_size, max_num_batched_tokens=48) as llm:
        first = llm.generate(prompts, GREEDY, use_tqdm=False)
        second = llm.generate(prompts, GREEDY, use_tqdm=False)
    expected = hf_greedy(path, prompts, GREEDY.max_tokens)
    assert [o.token_ids for o in first] == expected
    assert [o.token_ids for o in second] == expected
    assert [o.num_cached_tokens for o in second] == [len(p) - 1 for p in prompts]  # all but the last token


def test_layers_follow_mlp_only_layers_and_the_sparse_step():
    from tpengine.hf_config import is_sparse_layer
    config = as_hf_config(Qwen3MoeConfig(**CONFIG))
    assert [is_sparse_layer(config, i) for i in range(3)] == [True, False, True]  # layer 1 is mlp-only
    stepped = as_hf_config(Qwen3MoeConfig(**{**CONFIG, "mlp_only_layers": [], "decoder_sparse_step": 2,
                                             "num_hidden_layers": 4}))
    assert [is_sparse_layer(stepped, i) for i in range(4)] == [False, True, False, True]


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_routing_ties_and_top_k_order_follow_transformers(norm_topk_prob):
    # transformers' router over an identity weight sees exactly these logits
    config = Qwen3MoeConfig(**{**CONFIG, "hidden_size": 8, "norm_topk_prob": norm_topk_prob, "num_experts_per_tok": 3})
    router = Qwen3MoeTopKRouter(config)
    router.weight.data = torch.eye(8)
    logits = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    logits[0] = 1.0                               # every expert ties
    logits[1, [2, 5, 7]] = logits[1].max() + 1    # a three-way tie at the top
    logits[2, [6, 0]] = logits[2].max() + 1       # a tie for first, then the rest
    _, expected_weights, expected_ids = router(logits)
    weights, ids = select_experts(logits, 3, norm_topk_prob)
    assert torch.equal(ids, expected_ids) and torch.equal(weights, expected_weights)


def test_tp_must_divide_moe_intermediate_size(tmp_path):
    config = Qwen3MoeConfig(architectures=["Qwen3MoeForCausalLM"], **{**CONFIG, "moe_intermediate_size": 33})
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 must divide the model's moe_intermediate_size=33"):
        LLM(str(tmp_path), tensor_parallel_size=2)
