"""Incremental text and stop strings: every visible text is a prefix of the final one, the final text is
the tokenizer's own decode, stop strings are found across tokens and split UTF-8, and never leak."""
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tpengine import SamplingParams
from tpengine.engine.detokenizer import Detokenizer, IncrementalText
from tpengine.tiny_model import write_byte_tokenizer

CORPUS = [
    "Hello world, hello tensor parallel world!", "naïve café déjà vu — crème brûlée", "中文分词和张量并行",
    "emoji 🙂🚀 and more 🙂", "stop\n\nhere and there\n\n", "aaa bbb aaa bbb   spaced    out",
] * 20


def _wrap(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")


@pytest.fixture(scope="module")
def bpe_tokenizer():
    """Byte-level BPE trained here: merges across spaces, multi-byte characters split over tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    return _wrap(tokenizer)


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory):
    """The tiny model's tokenizer: one token per byte."""
    path = str(tmp_path_factory.mktemp("byte_tok"))
    write_byte_tokenizer(path)
    return PreTrainedTokenizerFast.from_pretrained(path)


@pytest.fixture(scope="module")
def metaspace_tokenizer():
    """A SentencePiece-style tokenizer (not byte level): the window decode path."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"])
    tokenizer.train_from_iterator(CORPUS, trainer)
    return _wrap(tokenizer)


def stream(tokenizer, params, prompt, completion):
    """Feed completion one token per step; returns (visible texts, final text, stop string)."""
    text = IncrementalText(Detokenizer(tokenizer), params, prompt)
    ids = prompt + completion
    visible = []
    for j in range(len(prompt), len(ids)):
        stop = text.append(ids, j, j + 1)
        if stop is not None:
            return visible, text.text, stop
        visible.append(text.visible_text)
    text.finish()
    return visible, text.text, None


def assert_prefixes(visible, final):
    for earlier, later in zip(visible, visible[1:] + [final]):
        assert later.startswith(earlier)


@pytest.mark.parametrize("which", ["bpe", "byte"])
def test_final_text_is_the_tokenizers_decode_and_every_step_a_prefix(which, bpe_tokenizer, byte_tokenizer):
    tokenizer = bpe_tokenizer if which == "bpe" else byte_tokenizer
    rng = random.Random(0)
    params = SamplingParams()
    for trial in range(40):
        if trial % 2:  # real text: multi-byte characters split over tokens never show as U+FFFD
            completion = tokenizer.encode(rng.choice(CORPUS[:6]) + rng.choice(CORPUS[:6]))
        else:  # random ids: invalid UTF-8 decodes as the tokenizer writes it
            completion = [rng.randrange(len(tokenizer)) for _ in range(30)]
        visible, final, _ = stream(tokenizer, params, [5, 6], completion)
        assert final == tokenizer.decode(completion, skip_special_tokens=True)
        assert_prefixes(visible, final)
        if trial % 2:
            assert not any("\ufffd" in v for v in visible)


def test_window_decoding_of_a_metaspace_tokenizer_streams_prefixes_of_its_decode(metaspace_tokenizer):
    tokenizer = metaspace_tokenizer
    prompt = tokenizer.encode("Hello world,")
    for line in CORPUS[:6]:
        completion = tokenizer.encode(" " + line)
        visible, final, _ = stream(tokenizer, SamplingParams(), prompt, completion)
        assert_prefixes(visible, final)
        whole, head = tokenizer.decode(prompt + completion), tokenizer.decode(prompt)
        assert final == whole[len(head):]


@pytest.mark.parametrize("which", ["bpe", "byte"])
@pytest.mark.parametrize("text, stop, expected", [
    ("stop\n\nhere and there", "\n\n", "stop"),                     # across tokens
    ("naïve café déjà vu", "café", "naïve "),
    ("中文分词和张量并行", "和张", "中文分词"),                         # split UTF-8 characters
    ("Hello world, hello", ["world", "lo w"], "Hel"),               # the earliest match wins
    ("emoji 🙂🚀 and more", "🚀", "emoji 🙂"),
])
def test_stop_string_cuts_the_text_before_it_and_never_shows(which, text, stop, expected, bpe_tokenizer,
                                                              byte_tokenizer):
    tokenizer = bpe_tokenizer if which == "bpe" else byte_tokenizer
    params = SamplingParams(stop=stop)
    visible, final, found = stream(tokenizer, params, [1], tokenizer.encode(text))
    assert final == expected and found in params.stop
    assert_prefixes(visible, final)
    with_stop = SamplingParams(stop=stop, include_stop_str_in_output=True)
    _, final, found = stream(tokenizer, with_stop, [1], tokenizer.encode(text))
    assert final == expected + found


def test_a_stop_string_in_the_prompt_is_not_matched(bpe_tokenizer):
    prompt = bpe_tokenizer.encode("stop\n\nhere")
    visible, final, found = stream(bpe_tokenizer, SamplingParams(stop="\n\n"), prompt, bpe_tokenizer.encode(" and"))
    assert found is None and final == " and"


def test_random_generations_never_leak_a_stop_string(bpe_tokenizer):
    rng = random.Random(1)
    for _ in range(60):
        completion = [rng.randrange(len(bpe_tokenizer)) for _ in range(40)]
        whole = bpe_tokenizer.decode(completion, skip_special_tokens=True)
        clean = whole.replace("\ufffd", "")
        start = rng.randrange(max(1, len(clean) - 3))
        stops = [clean[start:start + rng.randint(1, 3)] or "x", "zz"]
        visible, final, found = stream(bpe_tokenizer, SamplingParams(stop=stops), [1], completion)
        assert_prefixes(visible, final)
        assert not any(s in v for s in stops for v in visible)
        assert not any(s in final for s in stops)
        if found is not None:
            assert whole.startswith(final) and whole[len(final):].startswith(found)
