"""Qwen3-VL (dense) with images through LLM.chat gives transformers' greedy tokens: its vision tower with the
deepstack features added to the first decoder layers' image rows, interleaved M-RoPE. Its greedy runs at tp 1 and 2,
chunked and from the prefix cache, are tests/models/test_qwen2_5_vl.py's, parametrized over both families."""
from tests.models.test_qwen2_5_vl import GREEDY, QWEN3_VL, data_url, reference
from tests.models.vision import random_image, vl_checkpoint
from tpengine import LLM


def test_chat_with_an_image_url_matches_transformers():
    path, picture = vl_checkpoint(QWEN3_VL), random_image(7, 100, 70)
    conversation = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(picture)}},
                                                 {"type": "text", "text": "Describe it."}]}]
    with LLM(path, kvcache_block_size=16) as llm:
        reply = llm.chat(conversation, GREEDY, use_tqdm=False)[0]
        tokenizer = llm.get_tokenizer()
    template = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(template, add_generation_prompt=True, tokenize=False),
                              add_special_tokens=False)
    assert list(reply.outputs[0].token_ids) == reference(path, [(prompt, [picture])])[0]
