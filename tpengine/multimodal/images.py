"""Images into what the ranks' vision tower reads, on rank 0 before a request is queued: decoded, resized and
normalized by the checkpoint's own image processor (transformers', read from preprocessor_config.json), so the
pixels are the ones transformers would feed its model. A malformed image is refused here and never reaches a worker.

    PIL image -> processor (smart resize to min_pixels..max_pixels, rescale, normalize, patchify)
              -> ProcessedImage: float32 patch rows [t*h*w, C*T*P*P], the grid (t, h, w) in patches,
                 its placeholder-token count t*h*w / merge**2, and a content hash for the prefix cache
    Gemma 3: resized to one square, [C, side, side]; grid (1, side / P, side / P); mm_tokens_per_image tokens
"""
import base64
import binascii
import io
import os
import urllib.parse
from dataclasses import dataclass

import numpy as np
import xxhash

# A larger image is refused before it is decoded (PIL's own guard against decompression bombs is 2x its
# MAX_IMAGE_PIXELS, about 179M); the processor would shrink it to max_pixels anyway.
MAX_DECODED_PIXELS = 64 * 1024 * 1024


# what a request may change of the image processor (vLLM's mm_processor_kwargs): the pixel range images resize to
PROCESSOR_KWARGS = ("min_pixels", "max_pixels")


def checked_processor_kwargs(kwargs) -> dict[str, int]:
    """A request's mm_processor_kwargs: min_pixels and max_pixels, integers >= 1, min at most max; ValueError naming
    anything else."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise ValueError(f"mm_processor_kwargs must be a dict such as {{'max_pixels': 200704}}, got {kwargs!r:.60}")
    unknown = sorted(set(kwargs) - set(PROCESSOR_KWARGS))
    if unknown:
        raise ValueError(f"mm_processor_kwargs: {unknown} not supported; supported: {list(PROCESSOR_KWARGS)}")
    for name, value in kwargs.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"mm_processor_kwargs {name} must be an integer >= 1, got {value!r:.60}")
    if kwargs.get("min_pixels", 1) > kwargs.get("max_pixels", kwargs.get("min_pixels", 1)):
        raise ValueError(f"mm_processor_kwargs min_pixels={kwargs['min_pixels']} is more than "
                         f"max_pixels={kwargs['max_pixels']}")
    return dict(kwargs)


@dataclass(frozen=True)
class ProcessedImage:
    pixel_values: bytes            # float32 patch rows, row-major [t*h*w, channels * temporal_patch * patch**2]
                                   # (Gemma 3: the resized image, [channels, side, side])
    grid: tuple[int, int, int]     # (t, h, w) in patches, the processor's image_grid_thw row
    num_tokens: int                # the prompt's placeholder tokens for it: t*h*w / merge_size**2
    content_hash: int              # xxhash64 of the pixels and grid: the same image reuses cached K/V, another never

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]


def content_hash(pixel_values: bytes, grid: tuple[int, int, int]) -> int:
    h = xxhash.xxh64()
    h.update(np.asarray(grid, dtype=np.int64).tobytes())
    h.update(pixel_values)
    return h.intdigest()


class ImageProcessor:
    """The checkpoint's image processor, and the per-prompt limit on images (vLLM's --limit-mm-per-prompt).

    Qwen's processors resize each image within a pixel range and give its patch grid; an image's tokens are its
    merged patches. fixed_tokens (Gemma 3): the processor resizes every image to one square of patch_size patches,
    and each image takes that many tokens; pan-and-scan crops are not made."""

    def __init__(self, model_path: str, merge_size: int, limit_per_prompt: int, fixed_tokens: int | None = None,
                 patch_size: int = 14):
        from transformers import AutoImageProcessor
        if not os.path.isfile(os.path.join(model_path, "preprocessor_config.json")):
            raise ValueError(f"{model_path} has no preprocessor_config.json: an image model needs its image "
                             "processor's settings")
        self.processor = AutoImageProcessor.from_pretrained(model_path)
        self.merge_size = merge_size
        self.limit_per_prompt = limit_per_prompt
        self.fixed_tokens, self.patch_size = fixed_tokens, patch_size

    def process(self, images: list, processor_kwargs: dict | None = None) -> list[ProcessedImage]:
        """Each image's patches, resized within the request's min_pixels/max_pixels where it gives them (else the
        processor's own); ValueError naming the image (by its place in the prompt) that cannot be read."""
        if len(images) > self.limit_per_prompt:
            raise ValueError(f"the prompt has {len(images)} images, more than the limit of {self.limit_per_prompt} "
                             "per prompt (--limit-mm-per-prompt)")
        kwargs = checked_processor_kwargs(processor_kwargs)
        size = None
        if kwargs and self.fixed_tokens is not None:
            raise ValueError(f"mm_processor_kwargs {sorted(kwargs)}: this model's processor resizes every image to "
                             "one size, so pixel limits do not apply")
        if kwargs:
            own = self.processor.size
            size = {"shortest_edge": kwargs.get("min_pixels", own["shortest_edge"]),
                    "longest_edge": kwargs.get("max_pixels", own["longest_edge"])}
            if size["shortest_edge"] > size["longest_edge"]:
                raise ValueError(f"mm_processor_kwargs: min_pixels {size['shortest_edge']} is more than max_pixels "
                                 f"{size['longest_edge']}")
        return [self._process_one(image, i, size) for i, image in enumerate(images)]

    def _process_one(self, image, index: int, size: dict | None = None) -> ProcessedImage:
        from PIL import Image
        if isinstance(image, ProcessedImage):  # processed already (a server's renderer thread did it)
            return self._checked(image, index)
        if not isinstance(image, Image.Image):
            raise ValueError(f"image {index} must be a PIL.Image.Image, got {type(image).__name__}")
        width, height = image.size
        if width * height > MAX_DECODED_PIXELS:
            raise ValueError(f"image {index} is {width}x{height}, more than {MAX_DECODED_PIXELS} pixels")
        options = {} if size is None else {"size": size}
        if self.fixed_tokens is not None:
            options["do_pan_and_scan"] = False
        try:
            out = self.processor(images=[image.convert("RGB")], return_tensors="np", **options)
        except (ValueError, OSError) as e:  # a truncated file surfaces when its pixels are first read
            raise ValueError(f"image {index} could not be processed: {e}") from None
        pixels = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
        if self.fixed_tokens is None:
            grid = tuple(int(x) for x in out["image_grid_thw"][0])
            assert pixels.shape[0] == grid[0] * grid[1] * grid[2], "the processor's patch rows follow its grid"
        else:  # one image [1, channels, side, side]: its grid in patches
            assert pixels.shape[0] == 1 and pixels.shape[2] == pixels.shape[3], "one square image, no crops"
            grid = (1, pixels.shape[2] // self.patch_size, pixels.shape[3] // self.patch_size)
        data = pixels.tobytes()
        return ProcessedImage(data, grid, self._num_tokens(grid), content_hash(data, grid))

    def _num_tokens(self, grid: tuple[int, int, int]) -> int:
        if self.fixed_tokens is not None:
            return self.fixed_tokens
        return grid[0] * grid[1] * grid[2] // self.merge_size ** 2

    def _checked(self, image: ProcessedImage, index: int) -> ProcessedImage:
        t, h, w = image.grid
        num_values = len(image.pixel_values) // 4
        if image.num_tokens != self._num_tokens(image.grid) or num_values % (t * h * w):
            raise ValueError(f"image {index}: its patches do not match its grid {image.grid}")
        return image


def decode_image(data: bytes, index: int):
    """A PIL image from an encoded file's bytes (PNG, JPEG, ...), its pixels read now: ValueError naming the image
    when they cannot be."""
    from PIL import Image
    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        if width * height > MAX_DECODED_PIXELS:
            raise ValueError(f"it is {width}x{height}, more than {MAX_DECODED_PIXELS} pixels")
        image.load()
    except (OSError, ValueError, Image.DecompressionBombError, SyntaxError) as e:
        raise ValueError(f"image {index} could not be decoded: {e}") from None
    return image


def load_image_url(url: str, index: int, allowed_local_media_path: str | None = None):
    """The image an image_url names: a data: URL (base64), or a file:// path under allowed_local_media_path.
    Nothing is fetched over the network: an http(s) URL is refused. ValueError naming the image."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        header, _, payload = url.partition(",")
        if not header.lower().startswith("data:image/") or not header.lower().endswith(";base64"):
            raise ValueError(f"image {index}: a data URL must be data:image/<type>;base64,<data>, got "
                             f"{header[:60]!r}")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"image {index}: its data URL is not valid base64") from None
        return decode_image(data, index)
    if scheme == "file":
        return decode_image(_read_local_file(url, index, allowed_local_media_path), index)
    if scheme in ("http", "https"):
        raise ValueError(f"image {index}: fetching images over the network is not enabled; send it as a data: URL "
                         "(base64) or a file:// path under --allowed-local-media-path")
    raise ValueError(f"image {index}: image_url must be a data: or file:// URL, got {url[:60]!r}")


def _read_local_file(url: str, index: int, allowed: str | None) -> bytes:
    if not allowed:
        raise ValueError(f"image {index}: file:// URLs need the server started with --allowed-local-media-path")
    path = os.path.realpath(urllib.parse.unquote(urllib.parse.urlparse(url).path))
    root = os.path.realpath(allowed)
    if os.path.commonpath([path, root]) != root:
        raise ValueError(f"image {index}: {path} is outside --allowed-local-media-path {root}")
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"image {index}: {e.strerror}: {path}") from None
