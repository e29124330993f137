"""Gemma 3 with images gives transformers' greedy tokens (its image processor, SigLIP tower and projector, and its
image tokens attending to each other both ways in prefill) at tp 1 and 2, blocks 16 and 256, chunked prefill (a
chunk never ends inside an image), prefix hits on the same image (one ending inside it) and misses on another,
preemption, and through LLM.chat; bad prompts are refused by name."""
import pytest

from tests.models.test_qwen2_5_vl import data_url
from tests.models.vision import (BOI_ID, GEMMA_IMAGE_ID, gemma3_checkpoint, gemma3_image_ids, hf_gemma3_greedy,
                                 random_image)
from tpengine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(gemma3_checkpoint())


def as_prompt(token_ids: list[int], images: list) -> dict:
    return {"prompt_token_ids": token_ids, **({"multi_modal_data": {"image": images}} if images else {})}


def image_requests(tokenizer, tokens_per_image: int = 4):
    """One image; two images of different sizes; text alone: (bare prompt ids, written-out ids, images)."""
    small, wide = random_image(1, 50, 40), random_image(2, 90, 30)
    one = gemma3_image_ids(tokenizer, "describe this image please ", 1, " now tell", tokens_per_image)
    two = gemma3_image_ids(tokenizer, "two: ", 2, " compare them", tokens_per_image)
    text = tokenizer.encode("just text here", add_special_tokens=False)
    return [(*one, [small]), (*two, [small, wide]), (text, text, [])]


def check_generates_as_transformers(llm: LLM, path: str, requests, params=GREEDY):
    outputs = llm.generate([as_prompt(bare, images) for bare, _, images in requests], params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == [full for _, full, _ in requests]  # as Gemma3Processor writes
    expected = [hf_gemma3_greedy(path, full, images, params.max_tokens) for _, full, images in requests]
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    return outputs


@pytest.mark.parametrize("tp, block_size, chunk, backend", [
    (1, 16, 16, "cpu"), (1, 256, 2048, "torch"), (2, 16, 16, "cpu"), (1, 16, 16, "triton")])
def test_greedy_matches_transformers_then_again_from_the_prefix_cache(tokenizer, tp, block_size, chunk, backend,
                                                                      monkeypatch):
    if backend == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # the workers inherit it
    path, requests = gemma3_checkpoint(), image_requests(tokenizer)
    with LLM(path, tensor_parallel_size=tp, kvcache_block_size=block_size, max_num_batched_tokens=chunk,
             attention_backend=backend) as llm:
        check_generates_as_transformers(llm, path, requests)
        again = check_generates_as_transformers(llm, path, requests)
    if block_size == 16:
        assert all(o.num_cached_tokens >= 16 for o in again[:2])


def test_the_prefix_cache_reuses_an_image_and_never_another(tokenizer):
    """A 16-token image from 20 to 36 in 16-token chunks and blocks: the chunk before it ends at 20, the image runs
    whole in the next; another image of the same size misses, the same image hits past it."""
    path = gemma3_checkpoint(tokens_per_image=16)
    bare, full = gemma3_image_ids(tokenizer, "a longer prompt: ", 1, " tell me", 16)
    assert full.index(GEMMA_IMAGE_ID) == 20
    first, other = random_image(3, 60, 60), random_image(4, 60, 60)
    with LLM(path, kvcache_block_size=16, max_num_batched_tokens=16) as llm:
        check_generates_as_transformers(llm, path, [(bare, full, [first])])
        different = check_generates_as_transformers(llm, path, [(bare, full, [other])])[0]
        same = check_generates_as_transformers(llm, path, [(bare, full, [other])])[0]
    assert different.num_cached_tokens <= 20 and same.num_cached_tokens > 36


def test_a_prefix_hit_ending_inside_an_image_computes_the_rest_of_it(tokenizer):
    """A text prompt takes the cache's later blocks (the last freed go first), so the image prompt then hits blocks
    up to 32 only, inside its image (20 to 36): the next chunk computes the image's last rows, which see all of it,
    over the cached K/V of its first ones (computed with the whole image in view)."""
    path = gemma3_checkpoint(tokens_per_image=16)
    bare, full = gemma3_image_ids(tokenizer, "a longer prompt: ", 1, " tell me", 16)
    filler = tokenizer.encode("z" * 50, add_special_tokens=False)
    image = random_image(3, 60, 60)
    with LLM(path, kvcache_block_size=16, max_num_batched_tokens=16, num_kvcache_blocks=6) as llm:
        check_generates_as_transformers(llm, path, [(bare, full, [image])])
        check_generates_as_transformers(llm, path, [(filler, filler, [])])
        inside = check_generates_as_transformers(llm, path, [(bare, full, [image])])[0]
    assert inside.num_cached_tokens == 32


def test_preemption_recomputes_images_and_still_matches(tokenizer):
    path = gemma3_checkpoint()
    requests = [(*gemma3_image_ids(tokenizer, f"p{i} ", 1, f" q{i}"), [random_image(10 + i, 40, 40)]) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with LLM(path, kvcache_block_size=16, num_kvcache_blocks=6, enable_prefix_caching=False) as llm:
        check_generates_as_transformers(llm, path, requests, params)


def test_chat_writes_out_image_parts_as_gemma3_processor_does(tokenizer, tmp_path):
    path = gemma3_checkpoint()
    picture, photo = random_image(5, 90, 60), random_image(6, 60, 120)
    photo.save(tmp_path / "photo.png")
    conversation = [{"role": "user", "content": [
        {"type": "text", "text": "Compare "}, {"type": "image_url", "image_url": {"url": data_url(picture)}},
        {"type": "text", "text": " with "},
        {"type": "image_url", "image_url": {"url": f"file://{tmp_path}/photo.png"}}]}]
    with LLM(path, kvcache_block_size=16, allowed_local_media_path=str(tmp_path)) as llm:
        reply = llm.chat(conversation, GREEDY, use_tqdm=False)[0]
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image"},
                                      {"type": "text", "text": " with "}, {"type": "image"}]}],
        add_generation_prompt=True, tokenize=False)
    run = "\n\n<start_of_image>" + "<image_soft_token>" * 4 + "<end_of_image>\n\n"  # Gemma3Processor's
    full = tokenizer.encode(rendered.replace("<start_of_image>", run), add_special_tokens=False)
    assert reply.prompt == rendered and reply.prompt_token_ids == full
    assert list(reply.outputs[0].token_ids) == hf_gemma3_greedy(path, full, [picture, photo], GREEDY.max_tokens)


@pytest.fixture(scope="module")
def gemma_llm():
    with LLM(gemma3_checkpoint(), kvcache_block_size=16, max_num_batched_tokens=64) as llm:
        yield llm


def test_bad_image_prompts_are_refused_by_name_and_others_still_run(gemma_llm, tokenizer):
    (bare, _, images), *_ = image_requests(tokenizer)
    image = random_image(1, 40, 40)
    cases = [
        (as_prompt(bare + [BOI_ID], images), "2 image placeholders (<start_of_image>, token id 257) but 1 images"),
        (as_prompt([1, 2, GEMMA_IMAGE_ID, GEMMA_IMAGE_ID, 3], [image]),
         "image 0's run of image tokens (id 259) is 2 tokens long: it must be 4 (mm_tokens_per_image)"),
        (as_prompt([1, GEMMA_IMAGE_ID, 2], []), "image tokens (id 259) is 1 tokens long"),
        ({**as_prompt(bare, images), "mm_processor_kwargs": {"max_pixels": 1000}}, "pixel limits do not apply"),
    ]
    for prompt, message in cases:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            gemma_llm.generate([prompt], GREEDY, use_tqdm=False)
    # a <start_of_image> with no image given is text, as transformers reads it
    assert len(gemma_llm.generate([as_prompt([1, BOI_ID, 2], [])], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 8
    assert len(gemma_llm.generate([as_prompt(bare, images)], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 8


def test_an_image_larger_than_a_step_and_backends_without_key_limits_are_refused(tokenizer):
    path = gemma3_checkpoint(tokens_per_image=16)
    bare, _ = gemma3_image_ids(tokenizer, "x", 1, "y", 16)
    with LLM(path, max_num_batched_tokens=8, max_model_len=256) as llm:
        with pytest.raises(ValueError, match="image 0 takes 16 tokens, more than max_num_batched_tokens=8"):
            llm.generate([as_prompt(bare, [random_image(1, 40, 40)])], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="attend to each other both ways"):
        LLM(path, batch_invariant=True)


def test_a_chunk_never_ends_inside_an_image_whose_tokens_attend_both_ways():
    from tpengine.engine.scheduler import cut_for_encoder
    from tpengine.engine.sequence import Sequence
    from tpengine.multimodal.images import ProcessedImage
    from tpengine.multimodal.prompt import ImagePlacement, MultiModalPrompt

    image = ProcessedImage(bytes(16), (1, 4, 4), 16, 1)
    multimodal = MultiModalPrompt([ImagePlacement(10, image), ImagePlacement(40, image)], None, 0, whole_images=True)
    seq = Sequence(list(range(64)), GREEDY, 16, multimodal=multimodal)
    seq.num_scheduled_tokens = 20  # [0, 20) would end inside the first image: it ends before it
    cut_for_encoder(seq, 1000)
    assert seq.num_scheduled_tokens == 10
    seq.num_cached_tokens, seq.num_scheduled_tokens = 10, 8  # the image starts the chunk: it runs whole
    cut_for_encoder(seq, 1000)
    assert seq.num_scheduled_tokens == 16
    seq.num_cached_tokens, seq.num_scheduled_tokens = 16, 4  # a prefix hit ended inside it: the rest of it runs
    cut_for_encoder(seq, 1000)
    assert seq.num_scheduled_tokens == 10
    seq.num_cached_tokens, seq.num_scheduled_tokens = 26, 24  # [26, 50) ends inside the second image
    cut_for_encoder(seq, 1000)
    assert seq.num_scheduled_tokens == 14


def test_a_lora_adapter_on_the_language_model_applies_to_image_and_text_prompts(tokenizer, tmp_path):
    """peft names Gemma 3's text layers model.language_model.layers.N...: they are the decoder's layers here, and
    the vision tower's linears take no adapter. Greedy tokens equal transformers' with peft's adapter applied."""
    import torch
    from peft import PeftModel
    from transformers import AutoImageProcessor, AutoModelForImageTextToText
    from tests.lora.adapters import make_peft_adapter
    from tpengine.lora.request import LoRARequest
    path = gemma3_checkpoint()
    base = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    adapter = make_peft_adapter(base, str(tmp_path / "adapter"),
                                targets=r".*language_model.*\.(q_proj|v_proj|gate_proj|down_proj)")
    reference = PeftModel.from_pretrained(base, adapter).eval()
    (bare, full, images), _, (text, _, _) = image_requests(tokenizer)
    pixel_values = AutoImageProcessor.from_pretrained(path)(images=images, return_tensors="pt")["pixel_values"]
    expected = []
    for ids, extra in ((full, dict(pixel_values=pixel_values, token_type_ids=torch.tensor([full]).eq(GEMMA_IMAGE_ID)
                                   .long())), (text, {})):
        ids = torch.tensor([ids])
        with torch.no_grad():
            out = reference.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                     do_sample=False, eos_token_id=None, pad_token_id=0, **extra)
        expected.append(out[0, ids.size(1):].tolist())
    assert expected[0] != hf_gemma3_greedy(path, full, images, 8)  # the adapter changes the tokens
    with LLM(path, enable_lora=True, max_lora_rank=8, kvcache_block_size=16) as llm:
        outputs = llm.generate([as_prompt(bare, images), as_prompt(text, [])], GREEDY, use_tqdm=False,
                               lora_request=LoRARequest("adapter", 1, adapter))
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected


def test_a_processor_resizing_to_another_size_than_the_tower_takes_is_refused_at_start(tmp_path):
    import json
    import shutil
    path = str(tmp_path / "gemma3")
    shutil.copytree(gemma3_checkpoint(), path)
    with open(f"{path}/preprocessor_config.json") as f:
        settings = json.load(f)
    with open(f"{path}/preprocessor_config.json", "w") as f:
        json.dump({**settings, "size": {"height": 48, "width": 48}}, f)
    with pytest.raises(ValueError, match="resizes images to 48x48, but its vision tower takes 32x32"):
        LLM(path)
