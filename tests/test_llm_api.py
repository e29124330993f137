"""The offline API vLLM users call: LLM.chat renders conversations as the server does and replies as transformers
would, get_tokenizer is the engine's tokenizer, and what vLLM's LLM has and tpengine lacks is refused by name."""
import os
import shutil

import pytest
from transformers import PreTrainedTokenizerBase

from tests.conftest import hf_greedy
from tpengine import LLM, SamplingParams
from tpengine.entrypoints.chat_template import render_chat
from tpengine.tiny_model import write_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
# writes out what the chat arguments hand it: content (a string, or text parts as <part>), tool calls with their
# arguments read as an object, the tools, a template variable, the generation prompt
PROBE_TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}]"
    "{% if m.content is string %}{{ m.content }}{% elif m.content %}{% for p in m.content %}<{{ p.text }}>"
    "{% endfor %}{% endif %}"
    "{% for c in m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}"
    "{% endfor %}"
    "{% if tools %}(tools:{% for t in tools %} {{ t.function.name }}{% endfor %}){% endif %}"
    "{% if greeting is defined %}{{ greeting }}{% endif %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.fixture(scope="module")
def llm(tied_model):
    with LLM(tied_model, kvcache_block_size=16) as llm:
        yield llm


def chat_prompt(llm, messages, **kwargs) -> str:
    [out] = llm.chat(messages, ONE_TOKEN, use_tqdm=False, chat_template=PROBE_TEMPLATE, **kwargs)
    return out.prompt


def test_chat_renders_as_the_server_and_replies_as_transformers(llm, tied_model):
    tokenizer = llm.get_tokenizer()
    [out] = llm.chat(CONVERSATION, GREEDY, use_tqdm=False)
    expected = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert out.prompt_token_ids == expected == render_chat(tokenizer, None, CONVERSATION, True, None)
    assert out.prompt == tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
    assert out.token_ids == hf_greedy(tied_model, [expected], GREEDY.max_tokens)[0]


def test_batched_conversations_reply_in_order_each_with_its_params(llm):
    conversations = [CONVERSATION, [{"role": "user", "content": "Another one"}]]
    params = [GREEDY, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)]
    batched = llm.chat(conversations, params, use_tqdm=False)
    alone = [llm.chat(c, p, use_tqdm=False)[0] for c, p in zip(conversations, params)]
    assert [(o.prompt, o.token_ids) for o in batched] == [(o.prompt, o.token_ids) for o in alone]
    assert [len(o.token_ids) for o in batched] == [8, 3]


def test_text_parts_are_joined_as_the_server_joins_them_or_kept_as_openai_parts(llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
             {"role": "assistant", "content": "c"}]
    assert chat_prompt(llm, parts) == "[user]ab[assistant]c[assistant]"
    assert chat_prompt(llm, parts, chat_template_content_format="string") == "[user]ab[assistant]c[assistant]"
    assert chat_prompt(llm, parts, chat_template_content_format="openai") == "[user]<a><b>[assistant]<c>[assistant]"


def test_tool_calls_tools_and_template_arguments_reach_the_template(llm):
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    assert chat_prompt(llm, messages, tools=tools, chat_template_kwargs={"greeting": "hey"},
                       add_generation_prompt=False) == "[user]Weather?[assistant]weather(Paris)(tools: weather)hey"
    assert call["function"]["arguments"] == '{"city": "Paris"}'  # the caller's message is left as it was


def test_continue_final_message_continues_the_assistants_text(llm):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    [out] = llm.chat(messages, ONE_TOKEN, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    assert out.prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nHel"


@pytest.mark.parametrize("messages, kwargs, error, match", [
    (CONVERSATION, dict(mm_processor_kwargs={"max_pixels": 4096}), ValueError, "reads no images"),
    (CONVERSATION, dict(lora_request=object()), ValueError, "lora_request needs an engine made with enable_lora"),
    (CONVERSATION, dict(chat_template_content_format="xml"), ValueError, "chat_template_content_format must be"),
    (CONVERSATION, dict(continue_final_message=True), ValueError, "needs add_generation_prompt=False"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], {}, ValueError,
     "conversation 0: this model .* reads no images"),
    ([CONVERSATION, [{"content": "no role"}]], {}, ValueError,
     "conversation 1: a message must be a dict with a 'role'"),
    ([], {}, ValueError, "conversation 0: a conversation must be a non-empty list of messages"),
])
def test_chat_refuses_what_it_cannot_honour_by_name(llm, messages, kwargs, error, match):
    with pytest.raises(error, match=match):
        llm.chat(messages, ONE_TOKEN, use_tqdm=False, **kwargs)


def test_chat_without_a_chat_template_asks_for_one_and_takes_one_given(tied_model, tmp_path):
    path = str(tmp_path / "no_template")
    shutil.copytree(tied_model, path)
    os.remove(os.path.join(path, "chat_template.jinja"))
    with LLM(path, kvcache_block_size=16) as llm:
        with pytest.raises(ValueError, match="no chat template: pass chat_template="):
            llm.chat(CONVERSATION, ONE_TOKEN, use_tqdm=False)
        assert chat_prompt(llm, CONVERSATION) == "[system]Be brief.[user]Hello there[assistant]"


def test_get_tokenizer_is_the_engines_and_a_folder_without_one_says_so(llm, tmp_path):
    tokenizer = llm.get_tokenizer()
    assert tokenizer is llm.tokenizer and isinstance(tokenizer, PreTrainedTokenizerBase)
    path = write_tiny_model(str(tmp_path / "no_tokenizer"), seed=0, with_tokenizer=False)
    with LLM(path, kvcache_block_size=16) as bare:
        with pytest.raises(ValueError, match="this model folder has no tokenizer"):
            bare.get_tokenizer()
        with pytest.raises(ValueError, match="no tokenizer"):
            bare.chat(CONVERSATION, ONE_TOKEN, use_tqdm=False)


def test_vllm_generate_arguments_without_a_feature_here_are_refused_by_name(llm):
    [out] = llm.generate([[1, 2, 3]], ONE_TOKEN, use_tqdm=False, lora_request=None, priority=None)
    assert len(out.token_ids) == 1
    with pytest.raises(ValueError, match=r"prompt 0: lora_request needs an engine made with enable_lora=True"):
        llm.generate([[1, 2, 3]], ONE_TOKEN, lora_request=object())
    with pytest.raises(NotImplementedError, match="priority"):
        llm.generate([[1, 2, 3]], ONE_TOKEN, priority=[1])
    with pytest.raises(TypeError, match="unexpected keyword argument 'temperature'"):
        llm.generate([[1, 2, 3]], ONE_TOKEN, temperature=0.5)


@pytest.mark.parametrize("method", ["encode", "reward", "sleep", "wake_up", "collective_rpc"])
def test_vllm_methods_without_a_feature_here_raise_not_implemented(llm, method):
    with pytest.raises(NotImplementedError, match=rf"LLM\.{method}\(\) is not supported"):
        getattr(llm, method)("some text")
