"""DeepSeek V3's multi-token-prediction layer as a speculative proposer (speculative_config method "mtp"): its drafts
equal a reference MTP layer built from transformers' own DeepSeek V3 layers over transformers' hidden states, after a
prompt and after a verify row whose drafts were partly accepted; greedy tokens with it equal transformers' at tp 1
and 2, with chunked prefill, prefix hits and preemption."""
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

from tests.conftest import random_prompts
from tests.models.deepseek import DEEPSEEK_V3, VOCAB, deepseek_checkpoint
from tests.models.parity import assert_parity
from tpengine import LLM, SamplingParams
from tpengine.attention import make_backend
from tpengine.distributed.messages import BlockTable, PrefillChunk, StepMessage
from tpengine.distributed.parallel_state import TensorParallelGroup, building_model_for
from tpengine.hf_config import load_hf_config
from tpengine.models.deepseek import DeepseekMtp
from tpengine.models.loader import load_model
from tpengine.models.registry import model_class
from tpengine.runner.inputs import InputBuilder
from tpengine.runner.kv_cache import KVCache, attention_layers_of
from tpengine.runner.mtp_drafter import MtpDrafter

MTP = {"method": "mtp", "num_speculative_tokens": 3, "adaptive": False}
NUM_LAYERS = DEEPSEEK_V3["num_hidden_layers"]


class ReferenceMtp:
    """transformers' DeepSeek V3 model for the hidden states, and its decoder layer with the checkpoint's MTP
    tensors: h = layer(eh_proj([enorm(embed(token)), hnorm(hidden)])), logits = lm_head(shared_head_norm(h)), the
    embedding zeroed at position 0 (vLLM's), every row attending causally with no cache."""

    def __init__(self, path: str):
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        config = self.model.config
        config._attn_implementation = "eager"
        tensors = load_file(f"{path}/model.safetensors")
        own = {name.removeprefix(f"model.layers.{NUM_LAYERS}."): tensor for name, tensor in tensors.items()
               if name.startswith(f"model.layers.{NUM_LAYERS}.")}
        self.layer = DeepseekV3DecoderLayer(config, NUM_LAYERS)
        experts = range(config.n_routed_experts)
        state = {name: tensor for name, tensor in own.items() if ".experts." not in name and name.startswith(
            ("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm."))}
        state["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([own[f"mlp.experts.{e}.gate_proj.weight"],
                                                                    own[f"mlp.experts.{e}.up_proj.weight"]])
                                                         for e in experts])
        state["mlp.experts.down_proj"] = torch.stack([own[f"mlp.experts.{e}.down_proj.weight"] for e in experts])
        self.layer.load_state_dict(state)
        self.norms = {}
        for name in ("enorm", "hnorm", "shared_head.norm"):
            self.norms[name] = DeepseekV3RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.norms[name].weight.data = own[f"{name}.weight"]
        self.eh_proj = own["eh_proj.weight"]

    @torch.no_grad()
    def drafts(self, tokens: list[int], num_drafts: int) -> list[int]:
        """The layer's greedy drafts after tokens (whose last one the verify row carries)."""
        hidden = self.model.model(input_ids=torch.tensor([tokens[:-1]])).last_hidden_state[0]
        row_tokens, drafts = list(tokens[1:]), []
        for _ in range(num_drafts):
            out = self._rows(torch.tensor(row_tokens), hidden)
            logits = self.model.lm_head(self.norms["shared_head.norm"](out[-1]))
            drafts.append(int(logits.argmax()))
            row_tokens.append(drafts[-1])
            hidden = torch.cat([hidden, out[-1:]])
        return drafts

    def _rows(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(len(tokens))
        embeds = self.model.model.embed_tokens(tokens).masked_fill((positions == 0)[:, None], 0.0)
        x = torch.cat([self.norms["enorm"](embeds), self.norms["hnorm"](hidden)], dim=-1) @ self.eh_proj.T
        mask = torch.full((len(tokens), len(tokens)), float("-inf")).triu(1)[None, None]
        rope = self.model.model.rotary_emb(x[None], positions[None])
        return self.layer(x[None], attention_mask=mask, position_ids=positions[None], position_embeddings=rope)[0]


def one_rank_drafter(path: str):
    """The model and its MTP drafter in this process, as one rank of tp 1 runs them, over a cache of 16 blocks."""
    config = load_hf_config(path)
    group = TensorParallelGroup(0, 1, process_group=object())
    with building_model_for(group):
        model = model_class(config)(config, make_backend("torch"))
        mtp = DeepseekMtp(config, make_backend("torch"))
    for module in (model, mtp):
        load_model(module, path)
        for layer in module.modules():
            if hasattr(layer, "prepack"):
                layer.prepack()
    mtp.share_with(model)
    KVCache([attention_layers_of(model), attention_layers_of(mtp)], 16, torch.float32, torch.device("cpu")).allocate(16)
    return model, MtpDrafter(mtp, group), InputBuilder(16, torch.device("cpu"))


@torch.inference_mode()
def test_drafts_equal_the_reference_layer_s_after_a_prompt_and_after_a_partly_accepted_verify_row():
    path = deepseek_checkpoint("v3")
    model, drafter, inputs = one_rank_drafter(path)
    reference = ReferenceMtp(path)
    prompt = random_prompts(41, [37], VOCAB)[0]

    def step(message: StepMessage) -> list[int]:
        message, forward, drafts = drafter.prepare(message, inputs)
        drafter.follow(message, model(forward.input_ids, forward.positions, forward.meta))
        return drafts

    # the prompt in two chunks: the second's step writes the first's K/V
    tables = [BlockTable(0, list(range(8)))]
    assert step(StepMessage(prefill=[PrefillChunk(0, prompt[:20], 0, False)], new_tables=tables)) == []
    assert step(StepMessage(prefill=[PrefillChunk(0, prompt[20:], 20, True)])) == []
    first = step(StepMessage(prefill=[PrefillChunk(0, [7], len(prompt), True, 3)]))  # 7: the sampled token
    assert first == reference.drafts(prompt + [7], 3)
    # the first draft accepted, then token 11: the next verify row starts two positions on
    second = step(StepMessage(prefill=[PrefillChunk(0, [11], len(prompt) + 2, True, 2)]))
    assert second == reference.drafts(prompt + [7, first[0], 11], 2)


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_with_mtp_equals_transformers_with_chunked_prefill_and_prefix_hits(tp):
    path = deepseek_checkpoint("v3")
    prompts = random_prompts(42, [5, 30, 70], VOCAB)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(path, tensor_parallel_size=tp, kvcache_block_size=16, max_num_batched_tokens=48,
             speculative_config=MTP) as llm:
        first = llm.generate(prompts, params, use_tqdm=False)
        second = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.spec_decode_stats
    assert_parity(path, prompts, first, 12)
    assert_parity(path, prompts, second, 12)
    assert stats["num_draft_tokens"] > 0


def test_preemption_with_mtp_after_a_warm_up_still_matches():
    path = deepseek_checkpoint("v3")
    prompts = random_prompts(43, [30, 31, 29, 40], VOCAB)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    # warmed up too: the warm-up's dummy sequences leave the drafter nothing
    with LLM(path, kvcache_block_size=16, num_kvcache_blocks=8, speculative_config=MTP, warm_up=True) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.num_preemptions > 0
    assert_parity(path, prompts, outputs, 20)


@pytest.mark.parametrize("name, change, message", [
    ("v2_lite", {}, "method 'mtp' needs a checkpoint with multi-token-prediction layers"),
    ("v3", {"pipeline_parallel_size": 2}, "method 'mtp' runs on one pipeline stage only"),
])
def test_mtp_without_its_layer_or_across_stages_is_refused_by_name(name, change, message):
    with pytest.raises(ValueError, match=message):
        LLM(deepseek_checkpoint(name), speculative_config=MTP, **change)
