"""Chat messages with images, as OpenAI's and vLLM's clients send them: each image content part becomes the part a
chat template renders as the image's placeholder ({"type": "image"}: Qwen2.5-VL's template writes
<|vision_start|><|image_pad|><|vision_end|>), and its image is read, in the order the parts appear."""
from typing import Any

# OpenAI's image part (a data: or file:// URL), and vLLM's offline one (a PIL image)
IMAGE_PART_TYPES = ("image_url", "image_pil")
UNSUPPORTED_PART_TYPES = {"video_url": "video", "input_audio": "audio", "audio_url": "audio", "file": "files"}


def take_images(messages: list[dict[str, Any]],
                allowed_local_media_path: str | None = None) -> tuple[list[dict[str, Any]], list]:
    """(the messages with each image part as {"type": "image"}, the images in order). ValueError naming a part
    that is not text or an image, or an image that cannot be read."""
    images, placed = [], []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, (list, tuple)):
            placed.append(message)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in IMAGE_PART_TYPES:
                images.append(read_image_part(part, len(images), allowed_local_media_path))
                parts.append({"type": "image"})
            elif kind in UNSUPPORTED_PART_TYPES:
                raise ValueError(f"content part type {kind!r}: {UNSUPPORTED_PART_TYPES[kind]} is not supported, "
                                 "images are the one modality")
            else:
                parts.append(part)
        placed.append({**message, "content": parts})
    return placed, images


def read_image_part(part: dict[str, Any], index: int, allowed_local_media_path: str | None):
    """The PIL image an image_url part ({"image_url": {"url": ...}} or {"image_url": "..."}) or an image_pil part
    holds."""
    from tpengine.multimodal.images import load_image_url
    if part["type"] == "image_pil":
        return part.get("image_pil")  # the image processor refuses anything but a PIL image, naming it
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str):
        raise ValueError(f"image {index}: an image_url part needs {{'image_url': {{'url': ...}}}}, got {value!r:.60}")
    return load_image_url(url, index, allowed_local_media_path)


def has_image_parts(messages: list[dict[str, Any]]) -> bool:
    return any(isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES
               for message in messages if isinstance(message, dict)
               and isinstance(message.get("content"), (list, tuple)) for part in message["content"])
