"""Qwen2.5-VL with images gives transformers' greedy tokens (its own image processor, vision tower and M-RoPE) at
tp 1 and 2, blocks 16 and 256, chunked prefill cutting through an image, prefix hits on the same image and misses on
another, preemption, and through LLM.chat with image_url and image_pil parts; bad images and prompts are refused by
name."""
import base64
import io

import pytest

from tests.models.vision import (IMAGE_TOKEN_ID, hf_image_greedy, image_prompt, qwen2_5_vl_checkpoint, random_image,
                                 vl_checkpoint)
from tpengine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
QWEN2_5_VL, QWEN3_VL = "Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration"
QWEN3_VL_MOE = "Qwen3VLMoeForConditionalGeneration"


def image_requests():
    """One image; two images of different sizes; text alone: (prompt token ids, images)."""
    small, large = random_image(1, 90, 60), random_image(2, 150, 120)
    return [(image_prompt([10, 20, 30], 1, [40, 50]), [small]),
            (image_prompt([11], 2, [41, 51, 61]), [small, large]),
            ([5, 6, 7, 8, 9], [])]


def as_prompt(token_ids: list[int], images: list) -> dict:
    return {"prompt_token_ids": token_ids, **({"multi_modal_data": {"image": images}} if images else {})}


def generate(llm: LLM, requests, params=GREEDY):
    return llm.generate([as_prompt(*request) for request in requests], params, use_tqdm=False)


def reference(path: str, requests, max_tokens: int = GREEDY.max_tokens) -> list[list[int]]:
    return [hf_image_greedy(path, token_ids, images, max_tokens) for token_ids, images in requests]


# chunks of 16 tokens cut through both images (12 and 20 placeholder tokens); Qwen3-VL: tests/models/test_qwen3_vl.py,
# Qwen3-VL MoE's expert layouts: test_qwen3_vl_moe.py
@pytest.mark.parametrize("architecture, tp, block_size, chunk", [
    (QWEN2_5_VL, 1, 16, 2048), (QWEN2_5_VL, 1, 256, 16), (QWEN2_5_VL, 2, 16, 16), (QWEN2_5_VL, 2, 256, 2048),
    (QWEN3_VL, 1, 16, 16), (QWEN3_VL, 2, 256, 2048), (QWEN3_VL_MOE, 1, 16, 16), (QWEN3_VL_MOE, 2, 256, 2048)])
def test_greedy_matches_transformers_then_again_from_the_prefix_cache(architecture, tp, block_size, chunk):
    path, requests = vl_checkpoint(architecture), image_requests()
    expected = reference(path, requests)
    with LLM(path, tensor_parallel_size=tp, kvcache_block_size=block_size, max_num_batched_tokens=chunk) as llm:
        first = generate(llm, requests)
        again = generate(llm, requests)
    assert [list(o.outputs[0].token_ids) for o in first] == expected
    assert [list(o.outputs[0].token_ids) for o in again] == expected
    # each image's placeholder grew to one token per merged patch, as transformers' processor grows it
    assert first[0].prompt_token_ids.count(IMAGE_TOKEN_ID) == 12
    if block_size == 16:
        assert all(o.num_cached_tokens >= 16 for o in again[:2])


def test_the_prefix_cache_reuses_an_image_and_never_another():
    path = qwen2_5_vl_checkpoint()
    text = image_prompt(list(range(30, 50)), 1, [60, 61, 62])  # the image's placeholders start at token 21
    first, other = random_image(3, 120, 90), random_image(4, 120, 90)  # same size: the same tokens
    with LLM(path, kvcache_block_size=16) as llm:
        generate(llm, [(text, [first])])
        same = generate(llm, [(text, [first])])[0]
        different = generate(llm, [(text, [other])])[0]
    assert same.num_cached_tokens > 21
    assert different.num_cached_tokens <= 21  # at most the text before the image
    assert list(different.outputs[0].token_ids) == reference(path, [(text, [other])])[0]


def test_preemption_recomputes_images_and_still_matches():
    path = qwen2_5_vl_checkpoint()
    requests = [(image_prompt([i, 20 + i], 1, [40 + i]), [random_image(10 + i, 100, 80)]) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with LLM(path, kvcache_block_size=16, num_kvcache_blocks=6, enable_prefix_caching=False) as llm:
        outputs = generate(llm, requests, params)
    assert [list(o.outputs[0].token_ids) for o in outputs] == reference(path, requests, 24)


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_chat_reads_image_url_and_image_pil_parts(tmp_path):
    path = qwen2_5_vl_checkpoint()
    picture, photo = random_image(5, 90, 60), random_image(6, 60, 120)
    photo.save(tmp_path / "photo.png")
    conversation = [{"role": "user", "content": [
        {"type": "text", "text": "Compare "}, {"type": "image_url", "image_url": {"url": data_url(picture)}},
        {"type": "text", "text": " with "}, {"type": "image_pil", "image_pil": photo}]}]
    on_disk = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"file://{tmp_path}/photo.png"}},
                                            {"type": "text", "text": "What is it?"}]}]
    with LLM(path, kvcache_block_size=16, allowed_local_media_path=str(tmp_path)) as llm:
        replies = llm.chat([conversation, on_disk], GREEDY, use_tqdm=False)
        tokenizer = llm.get_tokenizer()
    rendered = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
                for c in ([{"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image"},
                                                         {"type": "text", "text": " with "}, {"type": "image"}]}],
                          [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}])]
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in rendered]
    assert [r.prompt for r in replies] == rendered
    assert [list(r.outputs[0].token_ids) for r in replies] == reference(path, [(prompts[0], [picture, photo]),
                                                                             (prompts[1], [photo])])


@pytest.fixture(scope="module")
def vl_llm():
    with LLM(qwen2_5_vl_checkpoint(), kvcache_block_size=16, limit_mm_per_prompt={"image": 2}) as llm:
        yield llm


@pytest.mark.parametrize("prompt, message", [
    ({"prompt_token_ids": [1, 2], "multi_modal_data": {"video": [1]}}, "['video'] not supported"),
    (as_prompt(image_prompt([1], 2, [2]), [random_image(1, 60, 60)]), "2 image placeholders"),
    (as_prompt(image_prompt([1], 1, [2]), []), "1 image placeholders (runs of token id 259) but 0 images"),
    (as_prompt(image_prompt([1], 3, [2]), [random_image(1, 60, 60)] * 3), "more than the limit of 2 per prompt"),
    (as_prompt(image_prompt([1], 1, [2]), ["not an image"]), "image 0 must be a PIL.Image.Image, got str"),
    (as_prompt([1, IMAGE_TOKEN_ID, IMAGE_TOKEN_ID, 2], [random_image(1, 90, 60)]),
     "image 0's placeholder is 2 tokens long: it must be 1 token or its 12 tokens"),
])
def test_bad_image_prompts_are_refused_by_name_and_others_still_run(vl_llm, prompt, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        vl_llm.generate([prompt], GREEDY, use_tqdm=False)
    assert len(vl_llm.generate([as_prompt(*image_requests()[0])], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 8


@pytest.mark.parametrize("url, message", [
    ("https://example.com/cat.png", "fetching images over the network is not enabled"),
    ("data:image/png;base64,!!!", "not valid base64"),
    ("data:image/png;base64," + base64.b64encode(b"not a png").decode(), "image 0 could not be decoded"),
    ("file:///etc/passwd", "file:// URLs need the server started with --allowed-local-media-path"),
])
def test_bad_image_urls_in_chat_are_refused_by_name(vl_llm, url, message):
    conversation = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
    with pytest.raises(ValueError, match=message):
        vl_llm.chat(conversation, GREEDY, use_tqdm=False)


def test_a_request_s_pixel_limits_resize_its_images_as_transformers_does(vl_llm):
    token_ids, image = image_prompt([9, 8], 1, [7]), random_image(8, 300, 200)
    limits = {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 6}  # at most 6 merged patches, not 64
    output = vl_llm.generate([{**as_prompt(token_ids, [image]), "mm_processor_kwargs": limits}], GREEDY,
                             use_tqdm=False)[0]
    assert output.prompt_token_ids.count(IMAGE_TOKEN_ID) <= 6
    size = {"shortest_edge": limits["min_pixels"], "longest_edge": limits["max_pixels"]}
    assert list(output.outputs[0].token_ids) == hf_image_greedy(qwen2_5_vl_checkpoint(), token_ids, [image], 8, size)


@pytest.mark.parametrize("kwargs, message", [
    ({"num_crops": 4}, r"\['num_crops'\] not supported; supported: \['min_pixels', 'max_pixels'\]"),
    ({"max_pixels": 0}, "max_pixels must be an integer >= 1, got 0"),
    ({"min_pixels": 900, "max_pixels": 800}, "min_pixels=900 is more than max_pixels=800"),
])
def test_bad_pixel_limits_are_refused_by_name(vl_llm, kwargs, message):
    prompt = {**as_prompt(*image_requests()[0]), "mm_processor_kwargs": kwargs}
    with pytest.raises(ValueError, match=message):
        vl_llm.generate([prompt], GREEDY, use_tqdm=False)


def test_a_text_model_refuses_images(tiny_model):
    with LLM(tiny_model) as llm:
        with pytest.raises(ValueError, match="reads no images"):
            llm.generate([as_prompt([1, 2, 3], [random_image(1, 60, 60)])], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="limit_mm_per_prompt applies to image models"):
        LLM(tiny_model, limit_mm_per_prompt={"image": 1})


def test_a_step_starts_encoding_at_most_the_encoder_budget_of_image_tokens():
    from tpengine.engine.scheduler import cut_for_encoder
    from tpengine.engine.sequence import Sequence
    from tpengine.multimodal.images import ProcessedImage
    from tpengine.multimodal.prompt import place_images

    def image(h: int, w: int) -> ProcessedImage:  # grid in patches: h * w / 4 tokens
        return ProcessedImage(bytes(4 * h * w), (1, h, w), h * w // 4, h * w)

    token_ids, multimodal = place_images(image_prompt([1, 2], 2, [3]), [image(4, 6), image(8, 10)], IMAGE_TOKEN_ID, 2)
    first, second = multimodal.images  # 6 tokens at 3, 20 tokens at 11
    seq = Sequence(token_ids, GREEDY, 16, multimodal=multimodal)
    seq.num_scheduled_tokens = 32
    assert cut_for_encoder(seq, 16) == 10 and seq.num_scheduled_tokens == second.offset  # the second waits
    seq.num_cached_tokens, seq.num_scheduled_tokens = second.offset, 16
    assert cut_for_encoder(seq, 16) == -4 and seq.num_scheduled_tokens == 16  # starting the chunk, it runs
