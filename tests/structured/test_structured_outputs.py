"""Structured outputs offline: with random weights the grammar alone makes every output match (JSON schemas
of many shapes, regexes, choices), with n > 1, preemption and the mixed scheduler; requests without a grammar
in the same batch get exactly the tokens they get alone; a grammar the library rejects is a ValueError."""
import json
import os
import random
import re
import shutil

import jsonschema
import pytest

from tests.conftest import random_prompts
from tpengine import LLM, SamplingParams, StructuredOutputsParams

# Bounded shapes: a random model's output ends because the grammar runs out of choices, not by luck.
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                               "minItems": 1, "maxItems": 3},
                                      "ok": {"type": "boolean"}}, "required": ["tags", "ok"]},
    {"type": "object", "properties": {"pos": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -5, "maximum": 5}, "y": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["x", "y"]}}, "required": ["pos"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
                                      "kind": {"enum": ["x", "y", "z"]}}, "required": ["code", "kind"]},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                      {"type": "string", "maxLength": 3}, {"type": "null"}]}},
     "required": ["v"]},
    {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1,
                                                                        "maximum": 99}}, "required": ["id"]},
     "minItems": 1, "maxItems": 2},
]
REGEXES = [r"[a-z]{3,6}-\d{2}", r"(yes|no)!", r"\d{1,3}(\.\d)?", r"[A-F0-9]{4}"]
CHOICES = [["red", "green", "blue"], ["alpha", "beta"]]


def constraints():
    """(StructuredOutputsParams, check of a finished text) for every shape above."""
    for schema in SCHEMAS:
        yield (StructuredOutputsParams(json=schema, disable_any_whitespace=True),
               lambda text, schema=schema: jsonschema.validate(json.loads(text), schema))
        yield (StructuredOutputsParams(json=json.dumps(schema)),  # any whitespace, the schema as text
               lambda text, schema=schema: jsonschema.validate(json.loads(text), schema))
    for regex in REGEXES:
        yield StructuredOutputsParams(regex=regex), lambda text, regex=regex: _assert(re.fullmatch(regex, text))
    for choice in CHOICES:
        yield StructuredOutputsParams(choice=choice), lambda text, choice=choice: _assert(text in choice)


def _assert(condition) -> None:
    assert condition


def check_all(outputs, checks) -> None:
    for out, check in zip(outputs, checks, strict=True):
        for completion in out.outputs:
            assert completion.finish_reason == "stop", (completion.text, completion.finish_reason)
            check(completion.text)


@pytest.fixture(scope="module")
def llm(tied_model):
    # a small cache: the batch below preempts (recompute), and constrained sequences must keep their place
    with LLM(tied_model, kvcache_block_size=16, num_kvcache_blocks=40, max_model_len=512, max_num_seqs=16) as llm:
        yield llm


def test_every_output_matches_its_grammar_with_n_2_and_preemption(llm):
    rng = random.Random(0)
    cases = list(constraints()) * 4
    prompts = [f"request {i}: " + "x" * rng.randint(1, 60) for i in range(len(cases))]
    params = [SamplingParams(n=2, temperature=rng.choice([0.7, 1.0, 1.5]), seed=i, max_tokens=256,
                             structured_outputs=spec) for i, (spec, _) in enumerate(cases)]
    preemptions = llm.num_preemptions
    outputs = llm.generate(prompts, params, use_tqdm=False)
    check_all(outputs, [check for _, check in cases])
    assert llm.num_preemptions > preemptions, "the batch was meant to preempt"


def test_requests_without_a_grammar_get_the_same_tokens_beside_constrained_ones(llm):
    plain_prompts = random_prompts(5, [9, 30, 17], 250)
    plain = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
             SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True),
             SamplingParams(temperature=0.8, seed=8, max_tokens=16, ignore_eos=True)]
    alone = [o.token_ids for o in llm.generate(plain_prompts, plain, use_tqdm=False)]
    constrained = [(spec, check) for spec, check in constraints()][:6]
    outputs = llm.generate(plain_prompts + ["json please"] * len(constrained),
                           plain + [SamplingParams(temperature=1.0, seed=i, max_tokens=256, structured_outputs=spec)
                                    for i, (spec, _) in enumerate(constrained)], use_tqdm=False)
    assert [o.token_ids for o in outputs[:3]] == alone
    check_all(outputs[3:], [check for _, check in constrained])


@pytest.mark.parametrize("spec, message", [
    (dict(json={"type": "object", "properties": {"a": {"type": "no-such-type"}}}), "no-such-type"),
    (dict(regex="(unclosed"), "regex"),
    (dict(grammar="root ::= undefined_rule"), "undefined_rule"),
])
def test_a_grammar_the_library_rejects_is_a_value_error_naming_the_problem(llm, spec, message):
    with pytest.raises(ValueError, match=message) as error:
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(**spec)), use_tqdm=False)
    assert error.value.param == "structured_outputs"
    assert llm.generate(["still fine"], SamplingParams(max_tokens=2), use_tqdm=False)[0].finish_reason == "length"


def test_an_ebnf_grammar_and_json_object_are_followed(llm):
    grammar = 'root ::= "(" digits ("," digits)? ")"\ndigits ::= [0-9] | [0-9] [0-9]'
    outs = llm.generate(["g"] * 4, [SamplingParams(temperature=1.0, seed=i, max_tokens=64, structured_outputs=
                                                   StructuredOutputsParams(grammar=grammar)) for i in range(4)],
                        use_tqdm=False)
    assert all(re.fullmatch(r"\(\d{1,2}(,\d{1,2})?\)", o.text) and o.finish_reason == "stop" for o in outs)


def test_a_cached_grammar_is_not_compiled_again(llm):
    spec = StructuredOutputsParams(json=SCHEMAS[0], disable_any_whitespace=True)
    first = llm.grammar_compiler.compile(spec)
    first.result()
    assert llm.grammar_compiler.compile(spec) is not first  # a new future, served from xgrammar's cache
    assert llm.grammar_compiler.compile(spec).result() is not None


def test_structured_outputs_without_a_tokenizer_are_refused(tiny_model, tmp_path):
    for name in os.listdir(tiny_model):  # the weights and config, no tokenizer files
        if name.endswith((".json", ".safetensors")) and not name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(tiny_model, name), tmp_path)
    with LLM(str(tmp_path), kvcache_block_size=16, num_kvcache_blocks=16, max_model_len=64) as llm:
        assert llm.tokenizer is None
        with pytest.raises(ValueError, match="tokenizer") as error:
            llm.generate([[1, 2]], SamplingParams(structured_outputs=StructuredOutputsParams(regex="a")),
                         use_tqdm=False)
        assert error.value.param == "structured_outputs"


def test_vocabulary_beyond_the_tokenizer_is_masked(llm):
    # the model's vocabulary is larger than its byte tokenizer's: those ids are never in a grammar's output
    assert llm.vocab_size > len(llm.tokenizer)
    out = llm.generate(["v"], SamplingParams(temperature=50.0, seed=1, max_tokens=64,
                                             structured_outputs=StructuredOutputsParams(regex=r"[a-z]{5,20}")),
                       use_tqdm=False)[0]
    assert max(out.token_ids) < len(llm.tokenizer) and re.fullmatch(r"[a-z]{5,20}", out.text)




def test_json_strings_of_bounded_length_never_hold_raw_control_characters():
    # xgrammar writes a maxLength string's characters with a class that lets \x00-\x1f through; ours
    # replaces it (json.loads and JSON.parse refuse raw control characters)
    from tpengine.structured.compiler import json_schema_grammar
    schema = json.dumps({"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}}, "required": ["s"]})
    classes = re.findall(r"\[\^[^\]]*\]", str(json_schema_grammar(schema)))
    assert classes and all(r"\0-\x1f" in c for c in classes), classes


def test_with_a_reasoning_parser_the_grammar_constrains_the_answer_after_the_thinking(thinking_model, tied_model):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(thinking_model)
    think_start, think_end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    spec = StructuredOutputsParams(regex=r"[a-c]{3}\.")
    with LLM(thinking_model, kvcache_block_size=16, num_kvcache_blocks=32, max_model_len=256,
             reasoning_parser="qwen3") as llm:
        # a prompt that opened the thinking: it is free (here a bias makes </think> its first token), the answer after
        # it constrained
        thought = llm.generate(["q<think>"], SamplingParams(temperature=1.0, seed=3, max_tokens=32,
                                                            structured_outputs=spec, logit_bias={think_end: 100.0}),
                               use_tqdm=False)[0]
        assert thought.token_ids[0] == think_end and re.fullmatch(r"</think>[a-c]{3}\.", thought.text)
        # a prompt that did not open it, or closed it (a template with thinking off): constrained from the first token
        for prompt in ("q", "q<think></think>"):
            answer = llm.generate([prompt], SamplingParams(temperature=1.0, seed=4, max_tokens=32,
                                                           structured_outputs=spec, logit_bias={think_end: 100.0}),
                                  use_tqdm=False)[0]
            assert re.fullmatch(r"[a-c]{3}\.", answer.text) and answer.finish_reason == "stop"
        # a chat reply's first token may open its thinking instead (the mask allows <think> beside the grammar's)
        opened = llm.generate(["q"], SamplingParams(temperature=1.0, seed=5, max_tokens=8, structured_outputs=spec,
                                                    logit_bias={think_start: 100.0}, may_open_thinking=True),
                              use_tqdm=False)[0]
        assert opened.token_ids[0] == think_start and opened.finish_reason == "length"
    with pytest.raises(ValueError, match="</think>"):  # the plain byte tokenizer has no such token
        LLM(tied_model, reasoning_parser="qwen3")


def test_rank_0_reading_the_masks_inside_the_sampling_kernel_samples_what_masked_logits_sample():
    """The CPU kernel reads a grammar row's token mask as it samples (no pass writing -inf): greedy, seeded and
    unseeded rows, a row without a grammar and vocabulary slices get exactly the tokens that writing the mask into
    the logits first gives."""
    import torch
    import xgrammar as xgr

    from tpengine.kernels.cpu import sampling as cpu_sampling
    from tpengine.runner.sampler import Sampler
    from tpengine.sampling_params import SamplingRecord
    from tpengine.structured.compiler import GrammarCompiler
    from tpengine.structured.matcher import SequenceGrammar, apply_bitmask, fill_bitmask
    if not cpu_sampling.available():
        pytest.skip("the CPU sampling kernel does not build here")
    pieces = [bytes([b]) for b in range(256)] + [b'{"', b'":', b'name', b'age', b'"}', b' "', b'12', b'true']
    vocab = len(pieces) + 1
    info = xgr.TokenizerInfo(pieces + [b"<eos>"], vocab_type=xgr.VocabType.RAW, vocab_size=vocab,
                             stop_token_ids=[vocab - 1])
    compiler = GrammarCompiler(info)
    try:
        compiled = compiler.compile(StructuredOutputsParams(json=SCHEMAS[0])).result()
    finally:
        compiler.close()
    kinds = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=3), SamplingParams(temperature=1.3)]
    for num_slices in (1, 2):
        records, plain = [], []
        for row in range(12):
            params = kinds[row % 3]
            record = SamplingRecord(params, frozenset(), [1, 2, 3], 3)
            if row != 4:  # row 4 has no grammar
                record.grammar = SequenceGrammar(compiled)
                for token in b'{"name": "ab'[:row]:  # the matchers at different places in the grammar
                    assert record.grammar.accept(token)
            records.append(record)
            plain.append(SamplingRecord(params, frozenset(), [1, 2, 3], 3))
        logits = torch.randn(12, vocab, generator=torch.Generator().manual_seed(num_slices)) * 4
        rows = [i for i, r in enumerate(records) if r.grammar is not None]
        masked = logits.clone()
        apply_bitmask(masked, fill_bitmask(12, vocab, rows, [records[i].grammar for i in rows]), rows)
        got = Sampler(seed=0, num_vocab_slices=num_slices)(logits.clone(), records).token_ids
        expected = Sampler(seed=0, num_vocab_slices=num_slices)(masked, plain).token_ids
        assert got == expected
        assert all(masked[i, token] > float("-inf") for i, token in enumerate(got))


def test_a_bfloat16_engine_follows_every_grammar(tied_model):
    # bfloat16 logits (where the CPU computes in bfloat16; else the engine runs float32, as a user gets it)
    cases = list(constraints())[::3]
    with LLM(tied_model, dtype="bfloat16", kvcache_block_size=16, max_model_len=384) as llm:
        outputs = llm.generate([f"bf16 {i}" for i in range(len(cases))],
                               [SamplingParams(temperature=1.0, seed=i, max_tokens=256, structured_outputs=spec)
                                for i, (spec, _) in enumerate(cases)], use_tqdm=False)
    check_all(outputs, [check for _, check in cases])


def test_a_grammar_compiled_before_it_is_asked_for_again_never_deadlocks_the_engine_thread():
    """A compilation that is done before compile() attaches its callback (xgrammar's cache answers in
    microseconds) runs the callback on the calling thread: it must not wait for a lock that thread holds.
    Switching threads every microsecond makes that order common; before the fix this hung within 3,000 calls."""
    import sys
    import threading

    import xgrammar as xgr

    from tpengine.structured.compiler import GrammarCompiler
    info = xgr.TokenizerInfo([bytes([b]) for b in range(256)] + [b"<eos>"], vocab_type=xgr.VocabType.RAW,
                             vocab_size=257, stop_token_ids=[256])
    compiler = GrammarCompiler(info)
    spec = StructuredOutputsParams(regex=r"[a-z]{3}")
    compiler.compile(spec).result()
    finished = []

    def ask_again_and_again():
        for _ in range(3000):
            compiler.compile(spec).result()
        finished.append(True)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        thread = threading.Thread(target=ask_again_and_again, daemon=True)
        thread.start()
        thread.join(60)
    finally:
        sys.setswitchinterval(interval)
        compiler.close()
    assert finished, "compile() deadlocked on its own lock"
