"""A tiny random Qwen2.5-VL checkpoint written by transformers, with its image processor's settings, a byte
tokenizer holding the vision tokens and a chat template that places images as Qwen's does; images to feed it."""
import functools

import numpy as np
import torch

from tests.leftovers import session_folder
from tpengine.tiny_model import write_byte_tokenizer

# after the 256 bytes and EOS (256): the ids the checkpoint's config names
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
VISION_START_ID, VISION_END_ID, IMAGE_TOKEN_ID, VIDEO_TOKEN_ID = 257, 258, 259, 260
VOCAB = 320
# ChatML, an image part as Qwen2.5-VL's template writes it: its placeholder between the vision markers
VL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# head_dim 16: 8 frequencies, split 2 / 3 / 3 between temporal, height and width
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6, initializer_range=0.1,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            eos_token_id=256, bos_token_id=None)
# window 56 pixels: 2x2 merged patches per window, so images of more than one window attend in windows
VISION = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=14,
              spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1],
              initializer_range=0.1)
# Qwen3-VL: 16-pixel patches, a learned 4x4 position grid interpolated onto each image, deepstack from two layers
QWEN3_VISION = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=16,
                    spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                    deepstack_visual_indexes=[0, 1], initializer_range=0.1)
QWEN3_TEXT = dict(TEXT, head_dim=16)
# Qwen3-VL MoE: 4 experts, top 2, in layers 0 and 2; layer 1 dense. moe_intermediate_size 24, not 32: gate_up_proj
# [4, 48, 64] is not square, so its layout (transformers 5's or the released checkpoints' transposed one) shows
QWEN3_MOE_TEXT = dict(QWEN3_TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=[1])
# the processor resizes every image to between 8 and 64 merged patches (2x2 patches each)
MIN_MERGED_PATCHES, MAX_MERGED_PATCHES = 8, 64
# architecture -> (config class, text settings, vision settings, patch size)
FAMILIES = {"Qwen2_5_VLForConditionalGeneration": ("Qwen2_5_VLConfig", TEXT, VISION, 14),
            "Qwen3VLForConditionalGeneration": ("Qwen3VLConfig", QWEN3_TEXT, QWEN3_VISION, 16),
            "Qwen3VLMoeForConditionalGeneration": ("Qwen3VLMoeConfig", QWEN3_MOE_TEXT, QWEN3_VISION, 16)}


def qwen2_5_vl_checkpoint(seed: int = 0) -> str:
    return vl_checkpoint("Qwen2_5_VLForConditionalGeneration", seed)


@functools.lru_cache(maxsize=None)
def vl_checkpoint(architecture: str, seed: int = 0) -> str:
    import transformers
    from transformers import Qwen2VLImageProcessor
    config_class, text, vision, patch = FAMILIES[architecture]
    path = session_folder(prefix=f"tpengine-{architecture.lower()}-")
    write_byte_tokenizer(path, special_tokens=VISION_TOKENS, chat_template=VL_TEMPLATE)
    config = getattr(transformers, config_class)(
        text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN_ID, video_token_id=VIDEO_TOKEN_ID,
        vision_start_token_id=VISION_START_ID, vision_end_token_id=VISION_END_ID, eos_token_id=256,
        tie_word_embeddings=False)
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).to(torch.float32)
    with torch.no_grad():  # biases and norms drawn too, so they count
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.1)
            elif "norm" in name or name.endswith("ln_q.weight"):
                param.normal_(1.0, 0.1)
    model.generation_config.eos_token_id = 256
    model.save_pretrained(path, safe_serialization=True)
    merged = (2 * patch) ** 2  # pixels of one merged patch
    Qwen2VLImageProcessor(patch_size=patch, min_pixels=merged * MIN_MERGED_PATCHES,
                          max_pixels=merged * MAX_MERGED_PATCHES).save_pretrained(path)
    return path


def random_image(seed: int, width: int, height: int):
    """An RGB image of random pixels."""
    from PIL import Image
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def image_prompt(text_before: list[int], num_images: int, text_after: list[int]) -> list[int]:
    """Token ids: text, then each image's placeholder between the vision markers, then text."""
    return text_before + [VISION_START_ID, IMAGE_TOKEN_ID, VISION_END_ID] * num_images + text_after


@functools.lru_cache(maxsize=4)
def _hf_model(path: str):
    from transformers import AutoModelForImageTextToText
    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


def hf_image_greedy(path: str, prompt_token_ids: list[int], images: list, max_new_tokens: int,
                    processor_size: dict | None = None) -> list[int]:
    """transformers' greedy tokens for one prompt (its image placeholders one token each) and its images, through
    the checkpoint's own image processor (processor_size: its size setting overridden)."""
    from transformers import AutoImageProcessor
    model = _hf_model(path)
    input_ids = list(prompt_token_ids)
    kwargs = {}
    if images:
        processed = AutoImageProcessor.from_pretrained(path)(images=images, return_tensors="pt",
                                                             **({"size": processor_size} if processor_size else {}))
        merge = VISION["spatial_merge_size"] ** 2
        counts = iter((processed["image_grid_thw"].prod(-1) // merge).tolist())
        input_ids = [t for token in input_ids for t in ([token] * next(counts) if token == IMAGE_TOKEN_ID else [token])]
        # mm_token_type_ids (1: an image's token), as the processor gives it: without it transformers rotates by
        # the tokens' indices, not M-RoPE's positions
        kwargs = dict(pixel_values=processed["pixel_values"], image_grid_thw=processed["image_grid_thw"],
                      mm_token_type_ids=torch.tensor([[int(t == IMAGE_TOKEN_ID) for t in input_ids]]))
    ids = torch.tensor([input_ids])
    model.model.rope_deltas = None  # the previous prompt's: generate would reuse it
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0, **kwargs)
    return out[0, len(input_ids):].tolist()



# Gemma 3: after the 256 bytes and EOS (256), its image markers and image token as its config names them
BOI, EOI, GEMMA_IMAGE = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
BOI_ID, EOI_ID, GEMMA_IMAGE_ID = 257, 258, 259
# Gemma's turns; an image part is its <start_of_image>, as Gemma 3's template writes it
GEMMA_TEMPLATE = (
    "{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}<start_of_image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
# a full layer between two sliding ones of window 6: an image's 16 rows see each other past the window
GEMMA_TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, sliding_window=6, max_position_embeddings=2048,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention"], initializer_range=0.1,
                  eos_token_id=256, bos_token_id=None, pad_token_id=0)
# 32-pixel images in 8-pixel patches: 4x4 patches, pooled 2x2 into 4 image tokens
GEMMA_VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                    patch_size=8, vision_use_head=False, initializer_range=0.1)
GEMMA_TOKENS_PER_IMAGE = 4


@functools.lru_cache(maxsize=None)
def gemma3_checkpoint(seed: int = 0, tokens_per_image: int = GEMMA_TOKENS_PER_IMAGE) -> str:
    """A tiny random Gemma3ForConditionalGeneration, its image processor (32x32) and a byte tokenizer with the
    image markers."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessor
    path = session_folder(prefix="tpengine-gemma3-images-")
    write_byte_tokenizer(path, special_tokens=(BOI, EOI, GEMMA_IMAGE), chat_template=GEMMA_TEMPLATE)
    config = Gemma3Config(text_config=GEMMA_TEXT, vision_config=GEMMA_VISION, mm_tokens_per_image=tokens_per_image,
                          boi_token_index=BOI_ID, eoi_token_index=EOI_ID, image_token_index=GEMMA_IMAGE_ID,
                          eos_token_id=256, tie_word_embeddings=False)  # a tied random head repeats the last token
    config.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():  # biases and norms drawn too, so they count
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.1)
            elif "norm" in name:
                param.normal_(0.0 if "language_model" in name or "soft_emb" in name else 1.0, 0.1)
            elif name.endswith("mm_input_projection_weight"):
                param.normal_(0.0, 0.2)
    model.generation_config.eos_token_id = 256
    model.save_pretrained(path, safe_serialization=True)
    Gemma3ImageProcessor(size={"height": 32, "width": 32}).save_pretrained(path)
    return path


def gemma3_image_ids(tokenizer, text_before: str, num_images: int, text_after: str,
                     tokens_per_image: int = GEMMA_TOKENS_PER_IMAGE) -> tuple[list[int], list[int]]:
    """(the prompt's token ids with each image a bare <start_of_image>, the same written out as Gemma3Processor
    writes an image: "\\n\\n<start_of_image>" + its image tokens + "<end_of_image>\\n\\n")."""
    encode = functools.partial(tokenizer.encode, add_special_tokens=False)
    bare = encode(text_before) + [BOI_ID] * num_images + encode(text_after)
    run = encode("\n\n") + [BOI_ID] + [GEMMA_IMAGE_ID] * tokens_per_image + [EOI_ID] + encode("\n\n")
    return bare, encode(text_before) + run * num_images + encode(text_after)


def hf_gemma3_greedy(path: str, input_ids: list[int], images: list, max_new_tokens: int) -> list[int]:
    """transformers' greedy tokens for a prompt whose images are written out, with token_type_ids (1: an image
    token) as Gemma3Processor gives them: its image tokens attend to each other both ways."""
    from transformers import AutoImageProcessor
    model = _hf_model(path)
    kwargs = {}
    if images:
        pixel_values = AutoImageProcessor.from_pretrained(path)(images=images, return_tensors="pt")["pixel_values"]
        kwargs = dict(pixel_values=pixel_values,
                      token_type_ids=torch.tensor([[int(t == GEMMA_IMAGE_ID) for t in input_ids]]))
    ids = torch.tensor([input_ids])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0, **kwargs)
    return out[0, len(input_ids):].tolist()


def start_rank(rank: int, size: int, port: int):
    """A tower test's rank: one thread (two ranks share the test machine's cores) and its gloo group over the
    test's store: (store, group)."""
    from tpengine.distributed.parallel_state import TensorParallelGroup, connect_store, new_process_group
    torch.set_num_threads(1)
    store = connect_store(port)
    return store, TensorParallelGroup(rank, size, new_process_group(store, rank, size, torch.device("cpu"), "gloo"))


def end_rank(store, group, rank: int, size: int) -> None:
    """A tower test's rank done: every rank past its last all-reduce before any tears its communicator down, then
    gone without the interpreter's finalization (gloo's worker thread may still be dropping its last work then, and
    a thread that wants the GIL while Python finalizes aborts the process)."""
    import os
    store.set(f"done{rank}", "1")
    store.wait([f"done{other}" for other in range(size)])
    group.shutdown()
    os._exit(0)


def outputs_of_two_ranks(run_rank, data: dict, folder) -> list:
    """run_rank(rank, 2, port, inputs, outputs) in two real processes, data saved to inputs for them; what each
    rank saved to f"{outputs}.{rank}"."""
    from datetime import timedelta

    import torch.multiprocessing as mp
    from tpengine.distributed.parallel_state import serve_store
    inputs, outputs = str(folder / "inputs.pt"), str(folder / "outputs")
    torch.save(data, inputs)
    # the store is served from here, as rank 0's engine serves it: it outlives both ranks' teardown
    store = serve_store(timedelta(seconds=60))
    mp.spawn(run_rank, args=(2, store.port, inputs, outputs), nprocs=2)
    return [torch.load(f"{outputs}.{rank}") for rank in range(2)]
