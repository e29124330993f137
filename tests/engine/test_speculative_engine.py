"""Speculative decoding end to end on the tiny random model (whose greedy runs fall into loops: the n-gram
proposer's home ground) and with draft models (a layer of it, or another shape with its vocabulary): greedy
tokens equal transformers' at tp 1 and 2, block sizes 16 and 256, with chunked prefill, prefix hits and
preemption; every other request gets the tokens it gets without speculation."""
import pytest

from tests.conftest import TP_MODEL, hf_greedy, random_prompts
from tpengine import LLM, SamplingParams
from tpengine.config import MAX_SPECULATIVE_TOKENS
from tpengine.tiny_model import write_layer_draft, write_tiny_model

VOCAB = TP_MODEL["vocab_size"]
# adaptive off: every step drafts, so the counters these tests check do not hang on step times
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def prompts_with_a_loop(seed: int) -> list[list[int]]:
    loop = random_prompts(seed + 100, [5], VOCAB)[0] * 4
    return random_prompts(seed, [1, 16, 40, 100], VOCAB) + [loop]


@pytest.mark.parametrize("tp, block_size", [(1, 16), (1, 256), (2, 16), (2, 256)])
def test_greedy_with_speculation_equals_transformers_with_chunked_prefill_and_prefix_hits(tiny_model, tp,
                                                                                          block_size):
    prompts = prompts_with_a_loop(tp)
    expected = hf_greedy(tiny_model, prompts, GREEDY.max_tokens)
    with LLM(tiny_model, tensor_parallel_size=tp, kvcache_block_size=block_size, max_num_batched_tokens=48,
             max_model_len=256, speculative_config=NGRAM) as llm:
        first = llm.generate(prompts, GREEDY, use_tqdm=False)
        second = llm.generate(prompts, GREEDY, use_tqdm=False)  # prefix hits
        stats = llm.spec_decode_stats
    assert [o.outputs[0].token_ids for o in first] == expected
    assert [o.outputs[0].token_ids for o in second] == expected
    assert sum(o.num_cached_tokens for o in second) > 0
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    assert sum(stats["num_accepted_tokens_per_pos"]) == stats["num_accepted_tokens"]


def test_greedy_with_speculation_equals_transformers_through_preemptions(tiny_model):
    prompts = prompts_with_a_loop(7) + random_prompts(8, [30, 50], VOCAB)
    expected = hf_greedy(tiny_model, prompts, GREEDY.max_tokens)
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=12, max_model_len=256,
             speculative_config=NGRAM) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert llm.num_preemptions > 0 and llm.spec_decode_stats["num_accepted_tokens"] > 0
        assert llm.kv_cache_usage == 0.0
    assert [o.outputs[0].token_ids for o in outputs] == expected


def mixed_requests(expected_stop: int) -> list[SamplingParams]:
    """Seeded sampling (with and without a filter), a stop token, max_tokens, EOS, n > 1, and the features that
    decode one token a step (penalties, min_tokens, logprobs)."""
    return [
        SamplingParams(temperature=0.8, seed=1, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=1.2, top_p=0.8, seed=2, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[expected_stop]),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30),
        SamplingParams(temperature=0.7, seed=3, n=2, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, min_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0.5, seed=4, max_tokens=10, logprobs=2, ignore_eos=True),
    ]


@pytest.mark.parametrize("tp, method", [(1, "ngram"), (2, "ngram"), (1, "draft_model"), (2, "draft_model")])
def test_every_request_gets_the_tokens_it_gets_without_speculation(tiny_model, request, tp, method):
    loop_prompt = prompts_with_a_loop(3)[-1]
    greedy = hf_greedy(tiny_model, [loop_prompt], 30)[0]
    params = mixed_requests(expected_stop=greedy[12])
    prompts = [loop_prompt] * len(params)
    results = []
    for spec in (None, NGRAM if method == "ngram" else draft(request.getfixturevalue("other_draft"))):
        with LLM(tiny_model, tensor_parallel_size=tp, kvcache_block_size=16, max_model_len=256,
                 speculative_config=spec) as llm:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            if spec is not None:  # another model's drafts are right only by chance
                stats = llm.spec_decode_stats
                assert stats["num_draft_tokens"] > 0 and (method != "ngram" or stats["num_accepted_tokens"] > 0)
        results.append([[(c.token_ids, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs]
                        for o in outputs])
    assert results[0] == results[1]
    assert results[1][2][0][0][-1] == greedy[12] and results[1][2][0][1] == "stop"


# --- a draft model ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def layer_draft(tiny_model, tmp_path_factory) -> str:
    """tiny_model's first layer with its embedding, norm and head: agrees with it on some tokens."""
    return write_layer_draft(tiny_model, str(tmp_path_factory.mktemp("layer_draft")), 1)


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory) -> str:
    """Another shape altogether (hidden 32, one layer, 2 heads of 16), the same vocabulary."""
    return write_tiny_model(str(tmp_path_factory.mktemp("other_draft")), seed=9, vocab_size=VOCAB, hidden_size=32,
                            intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                            head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True)


def draft(path: str, k: int = 4) -> dict:
    return {"model": path, "num_speculative_tokens": k, "adaptive": False}


@pytest.mark.parametrize("spec", ["ngram", "draft"])
def test_greedy_equals_transformers_whichever_steps_the_adaptive_policy_drafts_in(tiny_model, layer_draft, spec):
    prompts = prompts_with_a_loop(21) + random_prompts(22, [3, 9, 27], VOCAB)
    expected = hf_greedy(tiny_model, prompts, GREEDY.max_tokens)
    config = {**NGRAM, "adaptive": True} if spec == "ngram" else {"model": layer_draft, "num_speculative_tokens": 3}
    with LLM(tiny_model, kvcache_block_size=16, max_model_len=256, speculative_config=config) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


@pytest.mark.parametrize("tp, block_size", [(1, 16), (1, 256), (2, 16), (2, 256)])
def test_greedy_with_a_draft_model_equals_transformers_with_chunked_prefill_and_prefix_hits(
        tiny_model, layer_draft, tp, block_size):
    prompts = prompts_with_a_loop(tp + 10)
    expected = hf_greedy(tiny_model, prompts, GREEDY.max_tokens)
    with LLM(tiny_model, tensor_parallel_size=tp, kvcache_block_size=block_size, max_num_batched_tokens=48,
             max_model_len=256, speculative_config=draft(layer_draft)) as llm:
        first = llm.generate(prompts, GREEDY, use_tqdm=False)
        second = llm.generate(prompts, GREEDY, use_tqdm=False)  # prefix hits: the draft writes its K/V again
        stats = llm.spec_decode_stats
    assert [o.outputs[0].token_ids for o in first] == expected
    assert [o.outputs[0].token_ids for o in second] == expected
    assert sum(o.num_cached_tokens for o in second) > 0
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]


def test_a_draft_that_is_the_model_has_every_draft_accepted_through_preemptions(tiny_model):
    """Every draft kept: the last one's K/V, which no draft forward writes, comes from the verify forward."""
    prompts = prompts_with_a_loop(17) + random_prompts(18, [30, 50], VOCAB)
    expected = hf_greedy(tiny_model, prompts, GREEDY.max_tokens)
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=12, max_model_len=256,
             speculative_config=draft(tiny_model, 3)) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        stats = llm.spec_decode_stats
        assert llm.num_preemptions > 0 and llm.kv_cache_usage == 0.0
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert stats["num_accepted_tokens"] >= 0.9 * stats["num_draft_tokens"] > 0


def test_the_most_speculative_tokens_equal_transformers_and_more_are_refused_naming_the_limit(tiny_model):
    prompts = prompts_with_a_loop(7)[-2:]
    with LLM(tiny_model, max_model_len=256,
             speculative_config={**NGRAM, "num_speculative_tokens": MAX_SPECULATIVE_TOKENS}) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert len(llm.spec_decode_stats["num_accepted_tokens_per_pos"]) == MAX_SPECULATIVE_TOKENS
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(tiny_model, prompts, GREEDY.max_tokens)
    with pytest.raises(ValueError, match=f"num_speculative_tokens=100000 is more than the limit of "
                                         f"{MAX_SPECULATIVE_TOKENS}"):
        LLM(tiny_model, speculative_config={**NGRAM, "num_speculative_tokens": 100000})


def test_draft_models_the_engine_cannot_run_are_refused_by_name(tiny_model, other_draft, tmp_path):
    small_vocab = write_tiny_model(str(tmp_path / "small_vocab"), **{**TP_MODEL, "vocab_size": 600})
    with pytest.raises(ValueError, match="has a vocabulary of 600 tokens, the model 1003"):
        LLM(tiny_model, speculative_config=draft(small_vocab))
    with pytest.raises(ValueError, match="tensor_parallel_size=4 must divide the draft model .* 2 attention heads"):
        LLM(tiny_model, tensor_parallel_size=4, speculative_config=draft(other_draft))
    with pytest.raises(ValueError, match="config.json"):
        LLM(tiny_model, speculative_config=draft(str(tmp_path / "missing")))


def test_a_draft_model_with_fewer_positions_bounds_requests_and_a_float_draft_is_quantized_with_the_model(
        tiny_model, tmp_path):
    short = write_tiny_model(str(tmp_path / "short"), **{**TP_MODEL, "max_position_embeddings": 96})
    prompts = prompts_with_a_loop(5)[:3]
    with LLM(tiny_model, max_model_len=256, speculative_config=draft(short)) as llm:
        assert llm.max_model_len == 96
    outputs = []
    for spec in (None, draft(tiny_model)):  # int8 weights and inputs on both: the same tokens either way
        with LLM(tiny_model, quantization="int8", max_model_len=256, speculative_config=spec) as llm:
            outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)])
            if spec is not None:
                assert llm.spec_decode_stats["num_accepted_tokens"] > 0
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_stop_strings_end_a_speculating_request_where_they_end_it_without_speculation(tied_model, method):
    """A verify row's tokens are matched one at a time: the request ends at the token that completes the stop
    string, with the text, tokens and reasons it has without speculation (stop strings cut from the model's own
    greedy text, so they do occur: inside its loops, where drafts are accepted)."""
    prompts = ["abcabcabcabc", "hello hello hello hello"]
    plain = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with LLM(tied_model, kvcache_block_size=16, max_model_len=256) as llm:
        texts = [o.outputs[0].text for o in llm.generate(prompts, plain, use_tqdm=False)]
    requests = [(prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[text[at:at + n]],
                                        include_stop_str_in_output=include))
                for prompt, text in zip(prompts, texts) for n in (2, 4) for at in range(2, len(text) - n + 1, 5)
                for include in (False, True)]
    results = []
    for spec in (None, NGRAM if method == "ngram" else draft(tied_model)):
        with LLM(tied_model, kvcache_block_size=16, max_model_len=256, speculative_config=spec) as llm:
            outputs = llm.generate([p for p, _ in requests], [params for _, params in requests], use_tqdm=False)
            if spec is not None:
                assert llm.spec_decode_stats["num_accepted_tokens"] > 0
        results.append([(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
                         o.outputs[0].stop_reason) for o in outputs])
    assert results[0] == results[1]
    assert sum(reason == "stop" for _, _, reason, _ in results[0]) >= len(requests) // 2


def test_speculation_past_a_sliding_window_that_releases_blocks_equals_transformers_at_tp_2():
    from tests.models.families import WINDOW, family_checkpoint
    path = family_checkpoint("mistral_window")  # every layer slides: verify rows run while blocks are released
    loop = random_prompts(31, [5], 300)[0] * 4
    prompts = random_prompts(30, [20, WINDOW + 10, 150], 300) + [loop]
    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    with LLM(path, tensor_parallel_size=2, kvcache_block_size=16, num_kvcache_blocks=24, max_num_batched_tokens=32,
             speculative_config=NGRAM) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.spec_decode_stats["num_accepted_tokens"] > 0
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(path, prompts, 80)


def test_the_draft_model_runs_only_in_steps_that_draft_and_catches_up_before_it_proposes(tiny_model):
    """Four running: no step drafts (disable_by_batch_size=3) and the draft model does not run; once two have
    finished, each verify row first writes the draft K/V its sequence missed, so a draft that is the model has
    its drafts accepted again."""
    prompts = random_prompts(23, [20, 35, 50, 12], VOCAB)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (10, 12, 40, 40)]
    spec = {"model": tiny_model, "num_speculative_tokens": 3, "adaptive": False, "disable_by_batch_size": 3}
    with LLM(tiny_model, kvcache_block_size=16, max_model_len=256, speculative_config=spec) as llm:
        runner = llm.executor.runner
        counts = {"steps": 0, "draft model steps": 0}
        execute, mirror = runner.execute, runner.drafter.mirror

        def counting_execute(*args):
            counts["steps"] += 1
            return execute(*args)

        def counting_mirror(*args):
            counts["draft model steps"] += 1
            return mirror(*args)
        runner.execute, runner.drafter.mirror = counting_execute, counting_mirror
        outputs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.spec_decode_stats
    assert [o.outputs[0].token_ids for o in outputs] == [
        hf_greedy(tiny_model, [p], n)[0] for p, n in zip(prompts, (10, 12, 40, 40))]
    assert 0 < counts["draft model steps"] < counts["steps"] - 10
    assert stats["num_accepted_tokens"] >= 0.9 * stats["num_draft_tokens"] > 0


def test_prompts_prefilled_while_no_step_drafts_are_caught_up_when_their_sequences_draft(tiny_model):
    """Three decode rows stop drafting (disable_by_batch_size=3), so the prompt chunks prefilled meanwhile are
    not written for the draft model either; once rows finish, each verify row first writes what its sequence
    lacks, its prompt included, so a draft that is the model has its drafts accepted again."""
    prompts = random_prompts(24, [10, 12, 14, 60, 70], VOCAB)
    lengths = (30, 30, 30, 40, 40)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    spec = {"model": tiny_model, "num_speculative_tokens": 3, "adaptive": False, "disable_by_batch_size": 3}
    with LLM(tiny_model, kvcache_block_size=16, max_model_len=256, max_num_batched_tokens=24, max_num_seqs=5,
             speculative_config=spec) as llm:
        drafter = llm.executor.runner.drafter
        written = []
        mirror_prompts = drafter.mirror_prompts
        drafter.mirror_prompts = lambda step, inputs: written.append(
            sum(len(chunk.token_ids) for chunk in step.prefill)) or mirror_prompts(step, inputs)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.spec_decode_stats
    assert [o.outputs[0].token_ids for o in outputs] == [
        hf_greedy(tiny_model, [p], n)[0] for p, n in zip(prompts, lengths)]
    assert sum(written) < sum(map(len, prompts))  # chunks prefilled beside 3+ decode rows were skipped
    assert stats["num_accepted_tokens"] >= 0.9 * stats["num_draft_tokens"] > 0
