"""A prompt with images, as the ledger keeps it (no tensors): where each image's placeholder tokens sit, its
processed pixels for the ranks, and the prompt's M-RoPE positions.

An image holds its place in the prompt as one image token (<|image_pad|>, as a chat template writes it) that
grows here to one per merged patch, as transformers' processor expands it. The prefix cache tells images apart by
content: in the keys it hashes and compares (cache_keys), an image's placeholders become a value derived from the
image's hash, so the same image reuses cached K/V and another never does.
"""
from dataclasses import dataclass

import numpy as np

from tpengine.distributed.messages import ImageChunk
from tpengine.families import FAMILIES
from tpengine.multimodal.images import ImageProcessor, ProcessedImage, checked_processor_kwargs
from tpengine.multimodal.mrope_positions import image_runs, mrope_positions


@dataclass(frozen=True)
class ImagePlacement:
    offset: int                # its first placeholder token's index in the prompt
    image: ProcessedImage

    @property
    def end(self) -> int:
        return self.offset + self.image.num_tokens

    @property
    def cache_key(self) -> int:
        """What its placeholders read as in the prefix cache's keys: negative, so never a real token id."""
        return -1 - (self.image.content_hash >> 1)


class MultiModalPrompt:
    """The images of one prompt and, for M-RoPE, its rotary positions: [3, prompt length] (temporal, height, width),
    and the offset that every later token's position adds to its index (all three alike). positions None: each
    token's position is its index (Gemma 3). whole_images: an image's tokens attend to each other both ways, so a
    step computes all of an image's tokens or none."""

    __slots__ = ("images", "positions", "position_delta", "whole_images")

    def __init__(self, images: list[ImagePlacement], positions: np.ndarray | None, position_delta: int,
                 whole_images: bool = False):
        self.images = images
        self.positions = positions
        self.position_delta = position_delta
        self.whole_images = whole_images

    def cache_keys(self, token_ids: list[int], start: int, end: int) -> list[int]:
        """token_ids[start:end] with image placeholders as their images' keys."""
        keys = token_ids[start:end]
        for placement in self.images:
            lo, hi = max(placement.offset, start), min(placement.end, end)
            if lo < hi:
                keys[lo - start:hi - start] = [placement.cache_key] * (hi - lo)
        return keys

    def chunk_images(self, start: int, end: int) -> list[ImageChunk]:
        """The images whose placeholders tokens [start, end) overlap, with their pixels: a rank encodes an image
        when a chunk first needs it, and keeps its embeddings until the sequence's prompt is done."""
        return [ImageChunk(i, p.offset, p.image.num_tokens, list(p.image.grid), p.image.pixel_values)
                for i, p in enumerate(self.images) if p.offset < end and start < p.end]

    def chunk_positions(self, start: int, end: int) -> bytes:
        """The rows [start, end)'s positions, [3, end - start] int64 row-major: the prompt's from its table, a
        generated token's (recomputed after preemption) its index plus the delta. b"" without M-RoPE."""
        if self.positions is None:
            return b""
        num_prompt = self.positions.shape[1]
        rows = self.positions[:, start:min(end, num_prompt)]
        if end > num_prompt:
            later = np.arange(max(start, num_prompt), end, dtype=np.int64) + self.position_delta
            rows = np.concatenate([rows, np.broadcast_to(later, (3, len(later)))], axis=1)
        return np.ascontiguousarray(rows, dtype=np.int64).tobytes()


def place_images(token_ids: list[int], images: list[ProcessedImage], image_token_id: int,
                 spatial_merge_size: int) -> tuple[list[int], MultiModalPrompt]:
    """The prompt's tokens with each image's placeholder grown to its token count, and its MultiModalPrompt.
    Each run of image tokens is one image, in order: one token (expanded here) or already the image's count.
    ValueError when runs and images do not pair up."""
    starts, ends = image_runs(np.asarray(token_ids, dtype=np.int64), image_token_id)
    if len(starts) != len(images):
        raise ValueError(f"the prompt has {len(starts)} image placeholders (runs of token id {image_token_id}) "
                         f"but {len(images)} images were given")
    expanded, placements, cursor = [], [], 0
    for i, (start, end, image) in enumerate(zip(starts.tolist(), ends.tolist(), images)):
        if end - start not in (1, image.num_tokens):
            raise ValueError(f"image {i}'s placeholder is {end - start} tokens long: it must be 1 token or its "
                             f"{image.num_tokens} tokens")
        expanded += token_ids[cursor:start]
        placements.append(ImagePlacement(len(expanded), image))
        expanded += [image_token_id] * image.num_tokens
        cursor = end
    expanded += token_ids[cursor:]
    positions, delta = mrope_positions(expanded, [image.grid for image in images], image_token_id,
                                       spatial_merge_size)
    return expanded, MultiModalPrompt(placements, positions, int(delta))


class ImagePrompts:
    """Rank 0's side of an image model: a prompt's images processed and placed (ValueError naming what is wrong)."""

    def __init__(self, model_path: str, hf_config, images_per_prompt: int):
        merge_size = (hf_config.vision_config or {}).get("spatial_merge_size", 2)
        self.processor = ImageProcessor(model_path, merge_size, images_per_prompt)
        self.image_token_id, self.merge_size = hf_config.image_token_id, merge_size

    def expand_text(self, text: str) -> str:
        """A text prompt with images, as transformers' processor rewrites it before tokenizing: Qwen's placeholder
        is one special token, grown after tokenizing, so the text stays."""
        return text

    def place(self, token_ids: list[int], images: list,
              processor_kwargs: dict | None = None) -> tuple[list[int], MultiModalPrompt | None]:
        """The prompt's tokens with its images' placeholders grown, and its MultiModalPrompt (None: text alone);
        processor_kwargs: the request's pixel limits (vLLM's mm_processor_kwargs)."""
        checked_processor_kwargs(processor_kwargs)  # refused by name even where no image needs it
        if not images and self.image_token_id not in token_ids:
            return token_ids, None
        return place_images(token_ids, self.processor.process(images, processor_kwargs), self.image_token_id,
                            self.merge_size)


class WholeImagePrompts(ImagePrompts):
    """Gemma 3's images: each <start_of_image> in a prompt becomes, as Gemma3Processor writes it,
    "\n\n<start_of_image>" + mm_tokens_per_image image tokens + "<end_of_image>\n\n"; the image's tokens attend
    to each other both ways; positions are plain."""

    def __init__(self, model_path: str, hf_config, images_per_prompt: int, tokenizer):
        if tokenizer is None:
            raise ValueError(f"{model_path} has no tokenizer: Gemma 3's image prompts are written with its tokens")
        if all(t == "sliding_attention" for t in hf_config.layer_types or ()):
            raise ValueError("every layer of this Gemma 3 checkpoint slides: its images need a full-attention "
                             "layer (a step computes an image's tokens together)")
        vision = hf_config.vision_config or {}
        patch_size = vision.get("patch_size", 16)  # SiglipVisionConfig's defaults, as models/gemma3_vision.py's
        self.processor = ImageProcessor(model_path, 1, images_per_prompt, hf_config.mm_tokens_per_image, patch_size)
        side, size = vision.get("image_size", 224), self.processor.processor.size
        if (size.get("height"), size.get("width")) != (side, side):  # else every image would fail on the ranks
            raise ValueError(f"{model_path}'s preprocessor_config.json resizes images to {size.get('height')}x"
                             f"{size.get('width')}, but its vision tower takes {side}x{side} (vision_config "
                             "image_size)")
        self.image_token_id, self.num_tokens = hf_config.image_token_id, hf_config.mm_tokens_per_image
        self.boi_token_id, self.eoi_token_id = hf_config.boi_token_id, hf_config.eoi_token_id
        self.boi_text = tokenizer.convert_ids_to_tokens(self.boi_token_id)
        self.image_text = tokenizer.convert_ids_to_tokens(self.image_token_id)
        self.eoi_text = tokenizer.convert_ids_to_tokens(self.eoi_token_id)
        self.newlines = tokenizer.encode("\n\n", add_special_tokens=False)

    def expand_text(self, text: str) -> str:
        # in the text, before tokenizing, so the newlines merge with their neighbours as transformers' do
        run = f"\n\n{self.boi_text}{self.image_text * self.num_tokens}{self.eoi_text}\n\n"
        return text.replace(self.boi_text, run)

    def place(self, token_ids: list[int], images: list,
              processor_kwargs: dict | None = None) -> tuple[list[int], MultiModalPrompt | None]:
        checked_processor_kwargs(processor_kwargs)
        if not images and self.image_token_id not in token_ids:
            return token_ids, None  # a <start_of_image> without images is text, as transformers reads it
        processed = self.processor.process(images, processor_kwargs)
        expanded, placements, cursor = [], [], 0
        for i, (start, end) in enumerate(self._placeholders(token_ids, len(processed))):
            expanded += token_ids[cursor:start]
            if end - start == 1 and token_ids[start] == self.boi_token_id:  # grown here, as the processor would
                expanded += [*self.newlines, self.boi_token_id]
                placements.append(ImagePlacement(len(expanded), processed[i]))
                expanded += [self.image_token_id] * self.num_tokens + [self.eoi_token_id, *self.newlines]
            else:
                placements.append(ImagePlacement(len(expanded), processed[i]))
                expanded += token_ids[start:end]
            cursor = end
        expanded += token_ids[cursor:]
        return expanded, MultiModalPrompt(placements, None, 0, whole_images=True)

    def _placeholders(self, token_ids: list[int], num_images: int) -> list[tuple[int, int]]:
        """Each image's place: a run of image tokens (grown already, num_tokens long) or a <start_of_image> not
        followed by one; ValueError when they do not pair up with the images."""
        ids = np.asarray(token_ids, dtype=np.int64)
        starts, ends = image_runs(ids, self.image_token_id)
        places = list(zip(starts.tolist(), ends.tolist()))
        for i, (start, end) in enumerate(places):
            if end - start != self.num_tokens:
                raise ValueError(f"image {i}'s run of image tokens (id {self.image_token_id}) is {end - start} "
                                 f"tokens long: it must be {self.num_tokens} (mm_tokens_per_image)")
        bare = np.flatnonzero(ids == self.boi_token_id)
        places += [(b, b + 1) for b in bare.tolist() if b + 1 == len(ids) or ids[b + 1] != self.image_token_id]
        places.sort()
        if len(places) != num_images:
            raise ValueError(f"the prompt has {len(places)} image placeholders (<start_of_image>, token id "
                             f"{self.boi_token_id}) but {num_images} images were given")
        return places


def image_prompts_for(model_path: str, hf_config, images_per_prompt: int, tokenizer) -> ImagePrompts:
    """The image side of an image model's prompts: Gemma 3's whole images, or Qwen's."""
    if FAMILIES[hf_config.model_type].bidirectional_images:
        return WholeImagePrompts(model_path, hf_config, images_per_prompt, tokenizer)
    return ImagePrompts(model_path, hf_config, images_per_prompt)
