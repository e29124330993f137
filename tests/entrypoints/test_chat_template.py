"""Chat messages to prompt tokens: one BOS, --chat-template files, template variables, no template."""
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from tpengine.entrypoints.chat_template import load_chat_template, render_chat
from tpengine.tiny_model import CHATML_TEMPLATE

MESSAGES = [{"role": "user", "content": "hi"}]
LLAMA_LIKE_TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                       "{% if add_generation_prompt %}[assistant]{% endif %}")


def byte_tokenizer(*, bos: bool, chat_template: str | None) -> PreTrainedTokenizerFast:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<s>"])
    if bos:  # the tokenizer itself puts BOS first, as Llama's does
        tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 256)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", chat_template=chat_template)


def test_a_template_that_writes_bos_gets_exactly_one():
    tokenizer = byte_tokenizer(bos=True, chat_template=LLAMA_LIKE_TEMPLATE)
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert tokenizer.encode(text)[:2] == [256, 256]  # what encoding with special tokens would do
    ids = render_chat(tokenizer, None, MESSAGES, True, None)
    assert ids[0] == 256 and ids.count(256) == 1
    assert tokenizer.decode(ids) == "<s>[user]hi[assistant]"


def test_no_template_and_no_flag_is_an_error_that_names_the_flag():
    tokenizer = byte_tokenizer(bos=False, chat_template=None)
    with pytest.raises(ValueError, match="no chat template.*--chat-template"):
        render_chat(tokenizer, None, MESSAGES, True, None)


def test_chat_template_flag_reads_a_file_and_its_variables_come_from_the_request(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text("{{ greeting | default('none') }}:{% for m in messages %}{{ m['content'] }}{% endfor %}")
    template = load_chat_template(str(path))
    tokenizer = byte_tokenizer(bos=False, chat_template=None)
    assert tokenizer.decode(render_chat(tokenizer, template, MESSAGES, True, None)) == "none:hi"
    assert tokenizer.decode(render_chat(tokenizer, template, MESSAGES, True, {"greeting": "hey"})) == "hey:hi"


def test_chat_template_flag_rejects_what_is_neither_file_nor_template():
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_chat_template("no/such/file.jinja")


def test_generation_prompt_is_added_only_when_asked():
    tokenizer = byte_tokenizer(bos=False, chat_template=CHATML_TEMPLATE)
    with_prompt = tokenizer.decode(render_chat(tokenizer, None, MESSAGES, True, None))
    assert with_prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(render_chat(tokenizer, None, MESSAGES, False, None)) == "<|im_start|>user\nhi<|im_end|>\n"


def test_template_kwargs_that_clash_with_the_renderer_are_a_value_error():
    tokenizer = byte_tokenizer(bos=False, chat_template=CHATML_TEMPLATE)
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        render_chat(tokenizer, None, MESSAGES, True, {"tokenize": True})


def test_add_special_tokens_puts_the_tokenizers_bos_first_only_when_asked():
    # vLLM's request field: on by default for a text prompt, off for a chat (whose template writes its own BOS)
    import asyncio
    from tpengine.entrypoints.renderer import PromptRenderer
    renderer = PromptRenderer(byte_tokenizer(bos=True, chat_template=CHATML_TEMPLATE), None, 512)
    try:
        async def render():
            return (await renderer.encode(["hi"]), await renderer.encode(["hi"], add_special_tokens=False),
                    await renderer.render_chat(MESSAGES, True, None), await renderer.render_chat(
                        MESSAGES, True, None, add_special_tokens=True),
                    await renderer.encode(["<s><s>hi"], add_special_tokens=False))
        with_bos, without, chat, chat_with_bos, own = asyncio.run(render())
    finally:
        renderer.close()
    assert with_bos == [[256, *without[0]]] and 256 not in without[0]
    assert own == [[256, 256, *without[0]]]  # without special tokens, the text's own tokens, both of its BOS kept
    assert chat_with_bos == [256, *chat] and 256 not in chat


class ThreadRecordingTokenizer:
    """A tokenizer that notes the thread of each encode."""

    def __init__(self, tokenizer):
        self._tokenizer, self.threads = tokenizer, []

    def encode(self, text, add_special_tokens=True):
        import threading
        self.threads.append(threading.current_thread().name)
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_short_prompts_encode_on_the_event_loop_long_ones_on_the_renderers_thread():
    import asyncio
    import threading
    from tpengine.entrypoints.renderer import INLINE_ENCODE_CHARS, PromptRenderer
    renderer_tokenizer = ThreadRecordingTokenizer(byte_tokenizer(bos=False, chat_template=None))
    loop_tokenizer = ThreadRecordingTokenizer(byte_tokenizer(bos=False, chat_template=None))
    renderer = PromptRenderer(renderer_tokenizer, None, 8 * INLINE_ENCODE_CHARS, loop_tokenizer=loop_tokenizer)
    short, long = "a" * INLINE_ENCODE_CHARS, "b" * (INLINE_ENCODE_CHARS + 1)
    try:
        async def encode():
            return await renderer.encode([short]), await renderer.encode([long]), threading.current_thread().name
        (short_ids,), (long_ids,), loop_thread = asyncio.run(encode())
    finally:
        renderer.close()
    assert loop_tokenizer.threads == [loop_thread] and len(short_ids) == len(short)
    assert renderer_tokenizer.threads[0].startswith("tpengine-renderer") and len(long_ids) == len(long)
