"""Prompt logprobs against transformers' own log-softmax of its logits: every prompt position's token and top
alternatives, through chunked prefill, at tp 1 and 2; a prompt that shares scored blocks with an earlier one reuses
their K/V and their kept logprobs (computing fewer tokens) and still gets every position; max_tokens=0 scores a
prompt alone."""
import functools

import pytest
import torch

from tests.lora.adapters import write_tiny_base
from tpengine import LLM, SamplingParams

CONTEXT = [7 + 5 * j % 300 for j in range(40)]
# lm-eval's multiple choice: one context, several continuations, scored one after another
PROMPTS = [CONTEXT + [11, 12, 13], CONTEXT + [21, 22], CONTEXT + [31], [4, 5, 6, 7, 8]]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return write_tiny_base(str(tmp_path_factory.mktemp("prompt-logprobs") / "base"))


@functools.cache
def reference_logprobs(base: str, prompt: tuple[int, ...]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def check_against_reference(base: str, prompt: list[int], prompt_logprobs: list, k: int) -> None:
    reference = reference_logprobs(base, tuple(prompt))
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for position in range(1, len(prompt)):
        entry, row = prompt_logprobs[position], reference[position - 1]
        token = prompt[position]
        assert abs(entry[token] - row[token].item()) <= TOLERANCE
        top = row.topk(k).indices.tolist()
        assert set(top) <= set(entry) and len(entry) <= k + 1
        for t in entry:
            assert abs(entry[t] - row[t].item()) <= TOLERANCE


@pytest.mark.parametrize("tp", [1, 2])
def test_prompt_logprobs_equal_transformers_and_kept_blocks_spare_their_recomputation(base, tp):
    llm = LLM(base, kvcache_block_size=16, max_num_batched_tokens=24, tensor_parallel_size=tp)
    try:
        scoring = SamplingParams(max_tokens=0, prompt_logprobs=3)
        computed = []
        for prompt in PROMPTS:
            before = llm.prompt_tokens_total
            [out] = llm.generate([prompt], scoring, use_tqdm=False)
            computed.append(llm.prompt_tokens_total - before)
            check_against_reference(base, prompt, out.prompt_logprobs, 3)
            assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
        # the context's two whole blocks (K/V and logprobs) served the later continuations but for their last token,
        # whose row scores the first position after them: only it and the rest ran
        assert computed[1] == len(PROMPTS[1]) - 31 and computed[2] == len(PROMPTS[2]) - 31
        assert llm.prompt_logprob_cache.num_hits > 0
        # with generation after the prompt, and a smaller k served from the kept top alternatives
        [out] = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=1),
                             use_tqdm=False)
        check_against_reference(base, PROMPTS[0], out.prompt_logprobs, 1)
        assert len(out.outputs[0].token_ids) == 3
        # a scored prompt ends without a token even where requests are processed every step (logprobs asked)
        [out] = llm.generate([PROMPTS[3]], SamplingParams(max_tokens=0, prompt_logprobs=1, logprobs=1), use_tqdm=False)
        assert out.finished and out.outputs[0].token_ids == []
    finally:
        llm.shutdown()


def test_bad_prompt_logprobs_are_value_errors():
    with pytest.raises(ValueError, match=r"prompt_logprobs must be None or in \[0, 20\]"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match=r"max_tokens must be an integer >= 1 \(0 with prompt_logprobs\)"):
        SamplingParams(max_tokens=0)
