"""DeepSeek V2 and V3 (multi-head latent attention over a latent paged cache, DeepSeekMoE) give transformers' greedy
tokens at tp 1, 2 and 4 and pp 2, both block sizes, chunked prefill, prefix hits and preemption; prefill attends
absorbed or expanded with the same tokens; the interpreted Triton kernels read the latent cache; routing follows
transformers' routers, ties included; a block-FP8 checkpoint gives the tokens of its dequantized weights; `tpengine
generate --tp 4` runs the V3 shape on gloo."""
import json
import shutil

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from tests.conftest import as_hf_config, hf_greedy, random_prompts
from tests.models.deepseek import DEEPSEEK_V2_GROUPS, DEEPSEEK_V3, VOCAB, deepseek_checkpoint, fp8_checkpoints
from tests.models.parity import GREEDY, assert_parity, check_preemption, check_twice_with_prefix_hits
from tpengine import LLM
from tpengine.cli import main
from tpengine.hf_config import load_hf_config
from tpengine.models.deepseek import route_v2, route_v3

# one token, a block and a bit, past YaRN's 32-token window, several chunks of 48
PROMPT_LENGTHS = [1, 20, 45, 110]


# auto: the CPU's C++ decode kernel, the latents' first columns as its values; torch: the reference backend
@pytest.mark.parametrize("name, tp, block_size, backend", [
    ("v2_lite", 1, 16, "torch"), ("v2_lite", 2, 256, "auto"), ("v2_groups", 2, 16, "auto"), ("v3", 1, 256, "auto"),
    ("v3", 2, 16, "torch"), ("v3", 4, 16, "auto")])
def test_greedy_matches_transformers_with_chunked_prefill_and_prefix_hits(name, tp, block_size, backend):
    check_twice_with_prefix_hits(deepseek_checkpoint(name), random_prompts(31, PROMPT_LENGTHS, VOCAB),
                                 tensor_parallel_size=tp, kvcache_block_size=block_size, max_num_batched_tokens=48,
                                 attention_backend=backend)


@pytest.mark.parametrize("form", ["absorbed", "expanded"])
def test_prefill_absorbed_or_expanded_gives_the_same_tokens(form):
    # chunks of 48 over prompts up to 110: each later chunk reads the latents its earlier ones cached
    check_twice_with_prefix_hits(deepseek_checkpoint("v3"), random_prompts(32, PROMPT_LENGTHS, VOCAB),
                                 kvcache_block_size=16, max_num_batched_tokens=48, mla_prefill=form)


def test_preemption_under_a_small_cache_still_matches():
    check_preemption(deepseek_checkpoint("v2_lite"), random_prompts(5, [30, 31, 29, 40, 18], VOCAB), max_tokens=24)


def test_pipeline_stages_match_transformers():
    path = deepseek_checkpoint("v3")  # stage 0: the two dense layers; stage 1: the two MoE layers
    prompts = random_prompts(33, PROMPT_LENGTHS, VOCAB)
    with LLM(path, pipeline_parallel_size=2, kvcache_block_size=16, max_num_batched_tokens=48) as llm:
        assert_parity(path, prompts, llm.generate(prompts, GREEDY, use_tqdm=False))


def test_triton_backend_reads_the_latent_cache():
    pytest.importorskip("triton")
    check_twice_with_prefix_hits(deepseek_checkpoint("v3"), random_prompts(6, [3, 21], VOCAB), 4,
                                 kvcache_block_size=16, attention_backend="triton", mla_prefill="absorbed")


def test_generate_at_tp_4_on_gloo_matches_transformers(tied_model, capsys):
    path = deepseek_checkpoint("v3")  # one head per rank; the tied model's byte tokenizer reads the prompt
    assert main(["generate", "--model", path, "--tokenizer", tied_model, "--tp", "4", "--max-tokens", "5",
                 "--ignore-eos", "--json", "--quiet", "--block-size", "16", "latent attention"]) == 0
    output = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert output["token_ids"] == hf_greedy(path, [output["prompt_token_ids"]], 5)[0]


def test_a_kimi_k2_config_reads_as_deepseek_v3(tmp_path):
    # Kimi K2's config.json names model_type kimi_k2 (its remote code is DeepSeek V3's config class)
    path = deepseek_checkpoint("v3")
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    with open(tmp_path / "config.json") as f:
        config = json.load(f)
    with open(tmp_path / "config.json", "w") as f:
        json.dump({**config, "model_type": "kimi_k2"}, f)
    prompts = random_prompts(35, [9, 40], VOCAB)
    with LLM(str(tmp_path), kvcache_block_size=16) as llm:
        assert load_hf_config(str(tmp_path)) == load_hf_config(path)
        assert_parity(path, prompts, llm.generate(prompts, GREEDY, use_tqdm=False))


def test_lora_is_refused_naming_the_latent_attention():
    with pytest.raises(ValueError, match="enable_lora is not supported for deepseek_v3"):
        LLM(deepseek_checkpoint("v3"), enable_lora=True)


def test_block_fp8_checkpoint_gives_the_tokens_of_its_dequantized_weights():
    fp8, reference = fp8_checkpoints()
    prompts = random_prompts(34, PROMPT_LENGTHS, VOCAB)
    for tp in (1, 2):
        with LLM(fp8, tensor_parallel_size=tp, kvcache_block_size=16, max_num_batched_tokens=48) as llm:
            assert_parity(fp8, prompts, llm.generate(prompts, GREEDY, use_tqdm=False), oracle=reference)


def _ties(num_experts: int) -> torch.Tensor:
    logits = torch.randn(6, num_experts, generator=torch.Generator().manual_seed(0))
    logits[0] = 1.0                                   # every expert ties
    logits[1, [2, 5, 7]] = logits[1].max() + 1        # a three-way tie at the top
    logits[2, [6, 0]] = logits[2].max() + 1           # a tie for first, then the rest
    logits[3, 4:8] = logits[3].max() + 1              # a whole group ties
    return logits


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_v2_routing_follows_transformers_ties_included(method):
    config = DeepseekV2Config(**{**_settings(DEEPSEEK_V2_GROUPS), "hidden_size": 16, "n_routed_experts": 16,
                                 "topk_method": method})
    router = DeepseekV2TopkRouter(config)
    router.weight.data = torch.eye(16)
    logits = _ties(16)
    _, expected_weights, expected_ids = router(logits)
    ours = as_hf_config(config)
    weights, ids = route_v2(logits, ours.num_experts_per_tok, ours.topk_method, ours.n_group, ours.topk_group,
                            ours.routed_scaling_factor)
    assert torch.equal(ids, expected_ids) and torch.equal(weights, expected_weights)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_v3_routing_follows_transformers_ties_included(norm_topk_prob):
    config = DeepseekV3Config(**{**_settings(DEEPSEEK_V3), "hidden_size": 16, "norm_topk_prob": norm_topk_prob})
    router = DeepseekV3TopkRouter(config)
    router.weight.data = torch.eye(16)
    router.e_score_correction_bias.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    router.e_score_correction_bias[9:11] = 0.0  # ties within a group's top two
    logits = _ties(16)
    _, expected_weights, expected_ids = router(logits)
    ours = as_hf_config(config)
    weights, ids = route_v3(logits, router.e_score_correction_bias, ours.num_experts_per_tok, ours.n_group,
                            ours.topk_group, ours.norm_topk_prob, ours.routed_scaling_factor)
    assert torch.equal(ids, expected_ids) and torch.equal(weights, expected_weights)


def _settings(model: dict) -> dict:
    return {k: v for k, v in model.items() if k not in ("architecture", "with_tokenizer")}


@pytest.mark.parametrize("change, message", [
    (dict(n_group=3), "group-limited routing needs n_group dividing the 16 routed experts"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok=9 is more than the 8 experts of topk_group=2 groups"),
    (dict(head_dim=16), "head_dim=16 must equal qk_rope_head_dim=8"),
])
def test_routing_and_attention_settings_that_cannot_work_are_refused_by_name(change, message, tmp_path):
    DeepseekV3Config(architectures=["DeepseekV3ForCausalLM"], **{**_settings(DEEPSEEK_V3), **change}) \
        .save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path))
