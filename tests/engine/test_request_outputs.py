"""step() and generate() outputs as vLLM users read them: cumulative per-step outputs, n completions
sharing the prompt's blocks, abort mid-stream, requests of others left to step(), the engine seed."""
import pytest

from tests.conftest import TP_MODEL, hf_greedy, random_prompts
from tpengine import LLM, CompletionOutput, RequestOutput, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
VOCAB = TP_MODEL["vocab_size"]


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256) as llm:
        yield llm


def run_steps(llm) -> list[list[RequestOutput]]:
    steps = []
    while llm.has_unfinished_requests():
        steps.append(llm.step())
    return steps


def test_step_reports_every_request_that_got_a_token_cumulatively(llm, tiny_model):
    prompts = random_prompts(0, [5, 23], VOCAB)
    ids = [llm.add_request(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
           for p, n in zip(prompts, (3, 6))]
    seen = {i: [] for i in ids}
    for outputs in run_steps(llm):
        for out in outputs:
            seen[out.request_id].append(out)
    expected = hf_greedy(tiny_model, prompts, 6)
    for request_id, n, ref in zip(ids, (3, 6), expected):
        history = seen[request_id]
        assert [len(o.outputs[0].token_ids) for o in history] == list(range(1, n + 1))
        assert [o.finished for o in history] == [False] * (n - 1) + [True]
        assert all(isinstance(o.outputs[0], CompletionOutput) and o.outputs[0].index == 0 for o in history)
        assert history[-1].token_ids == ref[:n] and history[-1].finish_reason == "length"
        assert [o.finish_reason for o in history[:-1]] == [None] * (n - 1)


def test_generate_leaves_requests_added_before_to_step(llm, tiny_model):
    first, second = random_prompts(1, [9, 12], VOCAB)
    request_id = llm.add_request(first, GREEDY)
    [out] = llm.generate([second], GREEDY, use_tqdm=False)
    assert out.token_ids == hf_greedy(tiny_model, [second], GREEDY.max_tokens)[0]
    assert llm.has_unfinished_requests()
    final = [o for outputs in run_steps(llm) for o in outputs if o.request_id == request_id]
    assert final[-1].finished and final[-1].token_ids == hf_greedy(tiny_model, [first], GREEDY.max_tokens)[0]


def test_abort_in_the_middle_of_a_stream_ends_it_and_frees_its_blocks(llm):
    request_id = llm.add_request(random_prompts(2, [30], VOCAB)[0], SamplingParams(temperature=0.0, max_tokens=50))
    for _ in range(4):
        llm.step()
    assert llm.kv_cache_usage > 0 and llm.num_requests_running == 1
    aborted = llm.abort(request_id)
    assert aborted.finished and aborted.finish_reason == "abort" and len(aborted.token_ids) == 4
    assert llm.kv_cache_usage == 0.0 and llm.num_requests_running == 0
    assert [o.request_id for o in llm.step()] == [request_id]  # the next step reports the abort
    assert not llm.has_unfinished_requests() and llm.abort(request_id) is None


@pytest.mark.parametrize("prompt_len", [40, 48, 49])  # last block partly filled, exactly full, one token in
def test_n_greedy_completions_share_the_prompt_kv_and_each_matches_transformers(llm, tiny_model, prompt_len):
    prompt = random_prompts(3, [prompt_len], VOCAB)[0]
    before = llm.prompt_tokens_total
    [out] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, n=3),
                         use_tqdm=False)
    # the prompt is computed once; each other completion recomputes only its last token in a copied block
    assert llm.prompt_tokens_total - before <= prompt_len + 2
    expected = hf_greedy(tiny_model, [prompt], 8)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert [c.token_ids for c in out.outputs] == [expected] * 3


def test_seeded_n_is_reproducible_distinct_and_child_i_uses_seed_plus_i(llm):
    prompt = random_prompts(4, [20], VOCAB)[0]
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, n=4, seed=11)
    [first] = llm.generate([prompt], params, use_tqdm=False)
    [again] = llm.generate([prompt], params, use_tqdm=False)
    completions = [c.token_ids for c in first.outputs]
    assert completions == [c.token_ids for c in again.outputs]
    assert len({tuple(c) for c in completions}) == 4
    singles = llm.generate([prompt] * 4, [SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=11 + i)
                                          for i in range(4)], use_tqdm=False)
    assert [s.token_ids for s in singles] == completions


def test_metrics_count_tokens_and_report_cache_use(llm):
    prompt_before, generated_before = llm.prompt_tokens_total, llm.generation_tokens_total
    llm.generate([[1] * 10, [2] * 7], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert llm.generation_tokens_total - generated_before == 10
    assert 0 < llm.prompt_tokens_total - prompt_before <= 17
    assert llm.kv_cache_usage == 0.0 and llm.num_requests_waiting == 0 and llm.num_preemptions >= 0


def test_engine_seed_makes_unseeded_sampling_repeatable(tiny_model):
    prompts = random_prompts(5, [6, 9], VOCAB)
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    texts = {}
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=16, max_model_len=128, seed=seed) as engine:
            texts[name] = [o.token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
            # a per-request seed wins over the engine's
            [seeded] = engine.generate(prompts[:1], SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True,
                                                                   seed=99), use_tqdm=False)
            texts[name + "-seeded"] = seeded.token_ids
    assert texts["a"] == texts["b"] and texts["a"] != texts["c"]
    assert texts["a-seeded"] == texts["b-seeded"] == texts["c-seeded"]


@pytest.mark.parametrize("n", [1, 2])
def test_a_streamed_output_stays_the_snapshot_of_its_step(llm, n):
    """Outputs share their sequence's growing token list: one read only after later steps (and after
    the request ended) still shows exactly the tokens and logprobs of its own step."""
    import copy
    import pickle

    import msgspec

    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, logprobs=1, n=n)
    request_id = llm.add_request(random_prompts(3, [11], VOCAB)[0], params)
    history = [o for outputs in run_steps(llm) for o in outputs if o.request_id == request_id]  # read nothing yet
    final = history[-1]
    assert final.finished and all(len(c.token_ids) == 7 for c in final.outputs)
    # with n > 1 the completions need not get their tokens in the same steps: k counts per completion
    lengths = [[len(completion.token_ids) for completion in out.outputs] for out in history]
    for index in range(n):  # each step a completion got a token, its snapshot holds one more
        assert [step[index] for step in lengths] == sorted(step[index] for step in lengths)
    if n == 1:
        assert lengths == [[k] for k in range(1, 8)]
    for out, ks in zip(history, lengths):
        for completion, last, k in zip(out.outputs, final.outputs, ks):
            assert completion.token_ids == last.token_ids[:k]
            assert completion.logprobs == last.logprobs[:k]
            assert completion.token_ids == completion.token_ids  # a second read is the same list
            assert completion == copy.copy(completion) == pickle.loads(pickle.dumps(completion))
            encoded = msgspec.json.decode(msgspec.json.encode(completion))
            assert encoded["token_ids"] == last.token_ids[:k] and encoded["index"] == completion.index
            assert set(encoded) == {"index", "text", "token_ids", "finish_reason", "stop_reason", "logprobs",
                                    "cumulative_logprob"}
    assert msgspec.json.decode(msgspec.json.encode(history[0]))["outputs"][0]["token_ids"] == \
        final.outputs[0].token_ids[:1]
    assert all(msgspec.json.decode(msgspec.json.encode(out), type=RequestOutput) == out for out in history)


def test_a_completion_output_built_by_hand_is_a_plain_record():
    out = CompletionOutput(index=1, text="ab", token_ids=[3, 4], finish_reason=None)
    assert (out.token_ids, out.logprobs, out.stop_reason, out.cumulative_logprob, out.finished) == \
        ([3, 4], None, None, None, False)
    out.token_ids = [5]
    assert out.token_ids == [5] and out == CompletionOutput(index=1, text="ab", token_ids=[5], finish_reason=None)
    assert "token_ids=[5]" in repr(out)


def joined_deltas(outputs: list[RequestOutput]) -> dict[tuple[int, int], dict]:
    """Per (request, completion): its delta outputs joined, and how often it was reported finished."""
    joined = {}
    for out in outputs:
        for c in out.outputs:
            entry = joined.setdefault((out.request_id, c.index), dict(text="", token_ids=[], logprobs=[], ends=0))
            entry["text"] += c.text
            entry["token_ids"] += c.token_ids
            entry["logprobs"] += c.logprobs or []
            entry["ends"] += c.finish_reason is not None
            entry["finish_reason"], entry["stop_reason"] = c.finish_reason, c.stop_reason
    return joined


def test_delta_outputs_joined_equal_the_cumulative_ones(tied_model):
    from tpengine import RequestOutputKind
    prompts = ["Once upon a time", "The cat", "Hello there, general"]
    kinds = dict(greedy=dict(temperature=0.0), seeded=dict(temperature=1.0, seed=3))
    with LLM(tied_model, kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256) as llm:
        results = {}
        for output_kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
            finals, ids = {}, []
            for prompt, (name, sampling) in zip(prompts, [*kinds.items(), ("greedy", kinds["greedy"])]):
                params = SamplingParams(n=2, max_tokens=12, ignore_eos=True, logprobs=2, stop=["e ", "zz"],
                                        output_kind=output_kind, **sampling)
                ids.append(llm.add_request(prompt, params))
            outputs = []
            for step in range(40):
                if step == 3:
                    assert llm.abort(ids[2]).finished  # the same final output comes from the next step()
                if step == 5:  # generate() of another request: the streamed ones' outputs wait for step()
                    llm.generate(["x"], SamplingParams(max_tokens=2), use_tqdm=False)
                if not llm.has_unfinished_requests():
                    break
                outputs += llm.step()
            if output_kind == RequestOutputKind.CUMULATIVE:
                for out in outputs:
                    for c in out.outputs:
                        finals[out.request_id, c.index] = c
                results["cumulative"] = (ids, finals)
            else:
                results["delta"] = (ids, joined_deltas(outputs))
    (cumulative_ids, finals), (delta_ids, joined) = results["cumulative"], results["delta"]
    assert len(finals) == len(joined) == 6
    for old_id, new_id in zip(cumulative_ids, delta_ids):
        for index in range(2):
            final, entry = finals[old_id, index], joined[new_id, index]
            assert entry["token_ids"] == final.token_ids and entry["text"] == final.text
            # the second run's batches differ (prefix hits): its float32 logits may round in the last bits
            assert len(entry["logprobs"]) == len(final.logprobs) == len(entry["token_ids"])
            for ours, theirs in zip(entry["logprobs"], final.logprobs):
                assert ours.keys() == theirs.keys() and ours == pytest.approx(theirs, abs=1e-4)
            assert (entry["finish_reason"], entry["stop_reason"]) == (final.finish_reason, final.stop_reason)
            assert entry["ends"] == 1  # a completion's end is reported once


def steps_built_elsewhere(llm, on_step):
    """Run llm's steps to the end, their reports built on another thread behind them (as a server's event loop
    builds them); yields each step's built outputs, in order. on_step(k) runs before step k."""
    import queue
    import threading
    import time
    reports, built, ended = queue.SimpleQueue(), queue.SimpleQueue(), threading.Event()
    lags = []  # per build: steps run beyond the one built

    def build():
        while (step := reports.get()) is not None:
            while reports.qsize() < 2 and not ended.is_set():  # fall behind: two later steps run before it is built
                time.sleep(0.001)
            lags.append(reports.qsize())
            built.put(step.build())
        built.put(None)

    builder = threading.Thread(target=build)
    builder.start()
    try:
        steps = 0
        while llm.has_unfinished_requests():
            steps += 1
            on_step(steps)
            reports.put(llm.step_reports())
    finally:
        ended.set()
        reports.put(None)
        builder.join()
    assert max(lags) >= 2, "the builder never fell behind"
    while (outputs := built.get()) is not None:
        yield outputs


@pytest.mark.parametrize("kind", ["cumulative", "delta", "delta built on another thread"])
def test_plain_streams_report_what_generate_returns(tied_model, kind):
    """Streams of one completion without stop strings or logprobs (a server's usual request) have their outputs
    made when their reports are built, on another thread too. Beside requests that take the general path, with
    prefix hits, preemptions (a small cache) and an abort, each one's outputs add up to generate()'s result, every
    text only extends the last, and its end is reported once. The byte tokenizer's random bytes split characters
    across tokens."""
    import dataclasses

    from tpengine import RequestOutputKind
    delta = kind.startswith("delta")
    elsewhere = kind.endswith("another thread")
    output_kind = RequestOutputKind.DELTA if delta else RequestOutputKind.CUMULATIVE
    prompts = random_prompts(5, [9, 21, 40, 3, 17, 33], 256) + ["Once upon a time", "Once upon a time, there"]
    settings = [dict(temperature=0.0, max_tokens=30), dict(temperature=1.0, seed=7, max_tokens=17),
                dict(temperature=0.0, max_tokens=25, stop=["zz"]), dict(temperature=0.8, seed=1, max_tokens=1)]
    params = [SamplingParams(ignore_eos=True, **settings[i % len(settings)]) for i in range(len(prompts))]
    with LLM(tied_model, kvcache_block_size=16, num_kvcache_blocks=12, max_model_len=256) as llm:
        expected = llm.generate(prompts, params, use_tqdm=False)
        streamed = [dataclasses.replace(p, output_kind=output_kind) for p in params]
        ids = [llm.add_request(prompt, p) for prompt, p in zip(prompts, streamed)]
        seen = {request_id: dict(text="", token_ids=[], ends=0) for request_id in ids}
        aborted = []

        def abort(step):
            if step == 4:  # built here, or (elsewhere) with the next step's reports
                aborted.append(llm.abort(ids[1], build=not elsewhere))
            if step == 6:  # others' steps meanwhile: each stream's reports wait for step 6's, then one ends
                llm.generate(["x"], SamplingParams(max_tokens=3), use_tqdm=False)
                aborted.append(llm.abort(ids[4], build=not elsewhere))

        if elsewhere:
            steps = steps_built_elsewhere(llm, abort)
        else:
            def each_step():
                step = 0
                while llm.has_unfinished_requests():
                    step += 1
                    abort(step)
                    yield llm.step()
            steps = each_step()
        for step, outputs in enumerate(steps, 1):
            most = 4 if step == 6 else 1  # new tokens in a report: a step's, as that step had them
            for out in outputs:
                (completion,) = out.outputs
                entry = seen[out.request_id]
                if delta:
                    assert len(completion.token_ids) <= most
                    entry["text"] += completion.text
                    entry["token_ids"] += completion.token_ids
                else:
                    assert len(entry["token_ids"]) <= len(completion.token_ids) <= len(entry["token_ids"]) + most
                    assert completion.text.startswith(entry["text"])
                    assert completion.token_ids[:len(entry["token_ids"])] == entry["token_ids"]
                    entry["text"], entry["token_ids"] = completion.text, completion.token_ids
                entry["ends"] += completion.finish_reason is not None
                assert out.finished == (completion.finish_reason is not None)
        assert llm.num_preemptions > 0
        tokenizer = llm.tokenizer
    assert aborted == [None, None] if elsewhere else all(out.finished for out in aborted)
    for request_id, want in zip(ids, expected):
        entry = seen[request_id]
        assert entry["ends"] == 1
        if request_id in (ids[1], ids[4]):  # aborted part-way: what it reported is a start of the whole
            assert 0 < len(entry["token_ids"]) < len(want.outputs[0].token_ids)
            assert want.outputs[0].token_ids[:len(entry["token_ids"])] == entry["token_ids"]
        else:
            assert (entry["token_ids"], entry["text"]) == (want.outputs[0].token_ids, want.outputs[0].text)
        assert entry["text"] == tokenizer.decode(entry["token_ids"], skip_special_tokens=True)  # the tokenizer's own
