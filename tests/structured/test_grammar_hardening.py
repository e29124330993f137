"""Structured outputs under hostile input, offline: a grammar that ends ends its request (ignore_eos too), every
accepted request gets exactly one final output, specs over the limits or with keywords the grammar would not
enforce are refused by name, a grammar is parsed once and a slow compile delays only its own request, the cache
of compiled grammars stays within its bytes, and JSON whitespace is bounded."""
import json
import os
import random
import re
import string
import threading

import jsonschema
import pytest
import xgrammar as xgr

from tpengine import LLM, SamplingParams, StructuredOutputsParams
from tpengine.outputs import NO_TOKEN
from tpengine.structured.compiler import MAX_JSON_WHITESPACE, GrammarCompiler
from tpengine.structured.limits import MAX_GRAMMAR_CHARS, MAX_SCHEMA_DEPTH


@pytest.fixture(scope="module")
def llm(tied_model):
    with LLM(tied_model, kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=512, max_num_seqs=16) as llm:
        yield llm


def nested_schema(depth: int) -> dict:
    schema = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.mark.parametrize("spec, pattern", [
    (dict(choice=["a", "b"]), r"(a|b)"),
    (dict(regex=r"[0-9]{2}"), r"[0-9]{2}"),
    (dict(json={"type": "integer", "minimum": 0, "maximum": 9}), r"[0-9]"),
])
def test_a_grammar_that_ends_ends_its_request_with_ignore_eos(llm, spec, pattern):
    outputs = llm.generate(["x", "y"], SamplingParams(max_tokens=20, ignore_eos=True, temperature=1.0, seed=1,
                                                      structured_outputs=StructuredOutputsParams(**spec)),
                           use_tqdm=False)
    for output in outputs:
        completion = output.outputs[0]
        assert completion.finish_reason == "stop" and re.fullmatch(pattern, completion.text), completion.text


def test_every_accepted_request_gets_exactly_one_final_output(llm):
    eos = next(iter(llm.scheduler.eos_token_ids))
    e = llm.tokenizer.encode("e", add_special_tokens=False)[0]
    fresh = {"type": "object", "properties": {"never_compiled_before": {"enum": [1, 2]}},
             "required": ["never_compiled_before"]}
    plain = dict(temperature=1.0, seed=0)
    ids = {
        "length": llm.add_request("a", SamplingParams(max_tokens=3, **plain)),
        "stop token": llm.add_request("b", SamplingParams(max_tokens=40, logit_bias={eos: 100.0}, **plain)),
        "stop string": llm.add_request("c", SamplingParams(max_tokens=40, stop=["e"], logit_bias={e: 100.0},
                                                           **plain)),
        "grammar": llm.add_request("d", SamplingParams(max_tokens=9, structured_outputs=StructuredOutputsParams(
            choice=["yes", "no"]), **plain)),
        "grammar, ignore_eos, n=2": llm.add_request("e", SamplingParams(n=2, max_tokens=9, ignore_eos=True,
                                                                        structured_outputs=StructuredOutputsParams(
                                                                            regex="[xy]{3}"), **plain)),
        # a complete grammar allows only its stop token, which min_tokens rules out: the grammar ends it
        "grammar over min_tokens": llm.add_request("f", SamplingParams(max_tokens=9, min_tokens=8, ignore_eos=True,
                                                                       structured_outputs=StructuredOutputsParams(
                                                                           json={"enum": ["ok"]}), **plain)),
        "aborted while compiling": llm.add_request("g", SamplingParams(
            structured_outputs=StructuredOutputsParams(json=fresh), **plain), wait_for_grammar=False),
        "aborted queued": llm.add_request("h", SamplingParams(max_tokens=50, **plain)),
        "aborted running": llm.add_request("i", SamplingParams(max_tokens=50, **plain)),
    }
    llm.abort(ids["aborted while compiling"])
    llm.abort(ids["aborted queued"])
    finals: dict[int, int] = {}
    after_final = []
    for step in range(200):
        if step == 2:
            llm.abort(ids["aborted running"])
        for output in llm.step():
            if output.request_id in finals:
                after_final.append(output.request_id)
            if output.finished:
                finals[output.request_id] = finals.get(output.request_id, 0) + 1
        if not llm.has_unfinished_requests():
            break
    assert after_final == []
    assert {name: finals.get(request_id) for name, request_id in ids.items()} == {name: 1 for name in ids}
    assert llm.live_request_ids() == []


def test_a_complete_grammar_ends_a_completion_min_tokens_would_keep_going(llm):
    out = llm.generate(["q"], SamplingParams(max_tokens=9, min_tokens=8, structured_outputs=StructuredOutputsParams(
        json={"enum": ["ok"]})), use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason) == ('"ok"', "stop")


def test_non_finite_logits_fail_their_requests_with_an_error(nan_logits_model):
    with LLM(nan_logits_model, kvcache_block_size=16, num_kvcache_blocks=16, max_model_len=128) as llm:
        outputs = llm.generate(["x", "y"], [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, temperature=1.0,
                                                                                        seed=0)], use_tqdm=False)
    assert [(o.outputs[0].finish_reason, o.outputs[0].token_ids) for o in outputs] == [(NO_TOKEN, [])] * 2


@pytest.mark.parametrize("spec, message", [
    (dict(json=nested_schema(400)), f"limit of {MAX_SCHEMA_DEPTH}"),
    (dict(json='{"type": "object", "properties": {"a": ' * 1000 + '{"type": "integer"}' + "}}" * 1000),
     f"limit of {MAX_SCHEMA_DEPTH}"),
    (dict(json={"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}),
     f"limit of {MAX_GRAMMAR_CHARS}"),
    (dict(regex="a" * (MAX_GRAMMAR_CHARS + 1)), f"limit of {MAX_GRAMMAR_CHARS}"),
    (dict(choice=["x" * 40000, "y" * 40000]), f"limit of {MAX_GRAMMAR_CHARS}"),
    (dict(json={"type": "array", "uniqueItems": True}), "'uniqueItems'"),
    (dict(json={"type": "string", "format": "idn-email"}), "'format': 'idn-email'"),
    (dict(json={"properties": {"a": {"if": {"type": "integer"}, "then": {"minimum": 5}}}}), "'if'.* at #/properties/a"),
    (dict(json={"items": {"not": {"type": "integer"}}}), "'not'"),
    (dict(json={"allOf": [{"type": "integer"}, {"minimum": 5}]}), "'allOf' with more than one"),
    (dict(json={"type": "number", "multipleOf": 0.5}), "'multipleOf'"),
    (dict(json={"type": "object", "dependentRequired": {"a": ["b"]}}), "'dependentRequired'"),
])
def test_a_spec_over_a_limit_or_with_an_unenforced_keyword_is_refused_by_name(llm, spec, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(**spec)), use_tqdm=False)


def test_keywords_that_are_enforced_are_accepted_and_hold(llm):
    schema = {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"}},
              "patternProperties": {"^x$": {"type": "integer"}}, "required": ["id"], "additionalProperties": False}
    outputs = llm.generate(["u"] * 3, [SamplingParams(temperature=1.0, seed=i, max_tokens=200, structured_outputs=
                                                      StructuredOutputsParams(json=schema)) for i in range(3)],
                           use_tqdm=False)
    for output in outputs:
        value = json.loads(output.outputs[0].text)
        assert re.fullmatch(r"[0-9a-fA-F]{8}-([0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}", value["id"]), value


@pytest.mark.parametrize("spec, min_tokens, message", [
    (dict(grammar="root ::= root"), 0, "matches no text"),
    (dict(choice=["a", "bb"]), 5, "min_tokens=5 cannot be met: the choice constraint ends a completion after at "
                                  "most 3 tokens"),
    (dict(regex="[ab]"), 6, "min_tokens=6 cannot be met"),
])
def test_an_unsatisfiable_constraint_is_refused_naming_the_conflict(llm, spec, min_tokens, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate(["x"], SamplingParams(max_tokens=8, min_tokens=min_tokens,
                                           structured_outputs=StructuredOutputsParams(**spec)), use_tqdm=False)


def test_a_schema_is_parsed_once(llm, monkeypatch):
    calls = []
    parse = xgr.Grammar.from_json_schema
    monkeypatch.setattr(xgr.Grammar, "from_json_schema", staticmethod(
        lambda *args, **kwargs: calls.append(args[0]) or parse(*args, **kwargs)))
    schema = {"type": "object", "properties": {"parsed_once": {"type": "boolean"}}, "required": ["parsed_once"]}
    out = llm.generate(["p", "q"], SamplingParams(max_tokens=40, structured_outputs=StructuredOutputsParams(
        json=schema)), use_tqdm=False)
    assert [json.loads(o.outputs[0].text) in ({"parsed_once": True}, {"parsed_once": False}) for o in out] == [True] * 2
    assert len(calls) == 1


class HeldCompiles:
    """xgrammar's compiler, but a grammar whose text holds `marker` compiles only once released."""

    def __init__(self, compiler, marker: str):
        self.compiler, self.marker, self.release = compiler, marker, threading.Event()

    def compile_grammar(self, grammar):
        if self.marker in str(grammar):
            assert self.release.wait(60)
        return self.compiler.compile_grammar(grammar)


def test_a_slow_compile_delays_only_its_own_request(llm, monkeypatch):
    compiler = llm.grammar_compiler
    held = HeldCompiles(compiler._compiler, "slow_to_compile")
    monkeypatch.setattr(compiler, "_compiler", held)
    slow = StructuredOutputsParams(json={"type": "object", "properties": {"slow_to_compile": {"type": "integer"}}})
    slow_id = llm.add_request("s", SamplingParams(max_tokens=30, structured_outputs=slow), wait_for_grammar=False)
    others = [llm.add_request("o", SamplingParams(max_tokens=30, structured_outputs=StructuredOutputsParams(
                  json={"type": "object", "properties": {"quick": {"enum": [1]}}, "required": ["quick"]}))),
              llm.add_request("o", SamplingParams(max_tokens=30, structured_outputs=StructuredOutputsParams(
                  json_object=True))),
              llm.add_request("p", SamplingParams(max_tokens=5))]
    finished = set()
    while not finished.issuperset(others):
        finished.update(o.request_id for o in llm.step() if o.finished)
    assert slow_id not in finished
    held.release.set()
    while llm.has_unfinished_requests():
        finished.update(o.request_id for o in llm.step() if o.finished)
    assert slow_id in finished


def test_a_grammar_not_compiled_in_time_is_a_value_error_naming_the_limit(llm, monkeypatch):
    compiler = llm.grammar_compiler
    held = HeldCompiles(compiler._compiler, "never_in_time")
    monkeypatch.setattr(compiler, "_compiler", held)
    monkeypatch.setattr(compiler, "compile_timeout_s", 0.2)
    try:
        with pytest.raises(ValueError, match="did not compile within the limit of 0.2 s"):
            llm.generate(["t"], SamplingParams(structured_outputs=StructuredOutputsParams(
                json={"type": "object", "properties": {"never_in_time": {"type": "integer"}}})), use_tqdm=False)
        assert llm.generate(["t"], SamplingParams(max_tokens=2), use_tqdm=False)[0].finish_reason == "length"
    finally:
        held.release.set()


def resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def test_the_grammar_cache_stays_within_its_bytes_as_resident_memory_shows():
    rng = random.Random(0)
    vocab = [bytes([i]).decode("latin-1") for i in range(256)]
    seen = set(vocab)
    while len(vocab) < 32000:  # a real tokenizer's size: a compiled grammar holds masks over it
        word = "".join(rng.choice(string.ascii_letters + ' {}[]":,') for _ in range(rng.randint(2, 7)))
        if word not in seen:
            seen.add(word)
            vocab.append(word)
    limit = 8 * 2 ** 20
    compiler = GrammarCompiler(xgr.TokenizerInfo(vocab, stop_token_ids=[0]), cache_limit_bytes=limit)
    resident = {}
    try:
        for i in range(240):
            schema = {"type": "object", "properties": {f"field_{i}_{j}": {"type": "string", "maxLength": 20}
                                                       for j in range(30)}}
            compiler.compile(StructuredOutputsParams(json=schema)).result()
            if i + 1 in (80, 240):
                resident[i + 1] = resident_mib()
            assert compiler.cache.num_bytes <= limit
        held = compiler.cache.num_bytes / 2 ** 20
        # 160 more grammars of ~0.4 MiB each would add ~60 MiB if kept; within the bound RSS stays level
        assert resident[240] - resident[80] < 16, (resident, held)
        assert len(compiler.cache) < 80
    finally:
        compiler.close()


def test_json_whitespace_is_bounded_and_sampled_json_completes(llm):
    # a model that likes whitespace (a weak one's habit): unbounded, it fills its whole budget with it
    whitespace = {llm.tokenizer.encode(c, add_special_tokens=False)[0]: 3.0 for c in " \n"}
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "n": {"type": "integer"},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
              "required": ["name", "n", "tags"]}
    outputs = llm.generate(["j"] * 8, [SamplingParams(temperature=1.0, seed=i, max_tokens=300, logit_bias=whitespace,
                                                      structured_outputs=
                                                      StructuredOutputsParams(json=schema)) for i in range(8)],
                           use_tqdm=False)
    for output in outputs:
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), schema)
    outputs = llm.generate(["k"] * 8, [SamplingParams(temperature=1.0, seed=i, max_tokens=120, logit_bias=whitespace,
                                                      structured_outputs=
                                                      StructuredOutputsParams(json_object=True)) for i in range(8)],
                           use_tqdm=False)
    for output in outputs:
        between_strings = re.sub(r'"(?:[^"\\]|\\.)*"?', '""', output.outputs[0].text)  # strings may hold spaces
        runs = re.findall(r"[ \t\r\n]+", between_strings)
        assert all(len(run) <= MAX_JSON_WHITESPACE for run in runs), output.outputs[0].text
