"""The surrogate guard on top of xgrammar: a byte-level vocabulary's grammar lets ED A0 80 (a surrogate, which no
UTF-8 decoder takes) into a JSON string; with the guard no completion can write one, and every other character
still can."""
import json

import numpy as np
import xgrammar as xgr

from tpengine.sampling_params import StructuredOutputsParams
from tpengine.structured.compiler import GrammarCompiler
from tpengine.structured.matcher import SequenceGrammar, fill_bitmask

VOCAB_SIZE = 300  # a model's LM head may have more rows than the tokenizer's 256 byte tokens and EOS
EOS = 256
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 4}}, "required": ["city"]}


def byte_compiler() -> GrammarCompiler:
    vocab = [bytes([i]) for i in range(256)] + [b"</s>", b"\xed\xa0", b"ok"]
    return GrammarCompiler(xgr.TokenizerInfo(encoded_vocab=vocab, vocab_type=xgr.VocabType.RAW,
                                             vocab_size=VOCAB_SIZE, stop_token_ids=[EOS]))


def allowed(grammar: SequenceGrammar) -> set[int]:
    words = fill_bitmask(1, VOCAB_SIZE, [0], [grammar]).numpy().view("uint32")[0]
    return {t for t in range(VOCAB_SIZE) if words[t // 32] >> (t % 32) & 1}


def test_no_surrogate_can_follow_a_lone_ed_and_every_other_character_still_can():
    compiler = byte_compiler()
    spec = StructuredOutputsParams(json=json.dumps(SCHEMA))
    compiled = compiler.wait(compiler.compile(spec), spec)
    grammar = SequenceGrammar(compiled, guard=compiler.utf8_guard)
    for byte in b'{"city": "':
        assert grammar.accept(byte)
    assert 0xED in allowed(grammar)
    assert grammar.accept(0xED)
    after = allowed(grammar)
    assert not after & set(range(0xA0, 0xC0))      # ED A0..BF: a surrogate
    assert set(range(0x80, 0xA0)) <= after          # ED 80..9F: U+D000-D7FF, fine
    assert grammar.accept(0x9F) and grammar.accept(0xBF)
    assert bytes([0xED, 0x9F, 0xBF]).decode() == "\ud7ff"
    # the same bytes xgrammar alone would take
    bare = SequenceGrammar(compiled)
    for byte in b'{"city": "\xed':
        assert bare.accept(byte)
    assert 0xA0 in allowed(bare)


def test_a_token_that_holds_a_surrogate_is_never_allowed():
    compiler = byte_compiler()
    guard = compiler.utf8_guard
    surrogate_token = 257  # the bytes ED A0: half a surrogate in one token
    assert not guard.everywhere[surrogate_token // 32] >> (surrogate_token % 32) & 1
    assert guard.leaves_lead == frozenset({0xED})
    row = np.full(len(guard.everywhere), 0xFFFFFFFF, dtype=np.uint32)
    guard.restrict(row, after_lead=False)
    assert not row[surrogate_token // 32] >> (surrogate_token % 32) & 1 and row[0] & 1
