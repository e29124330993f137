"""What a prompt may be, as vLLM accepts it: a string, token ids (a list of ints or a 1-D integer array,
torch or numpy), or a dict {"prompt": str} / {"prompt_token_ids": [...]}; generate() also takes any
iterable of those. Anything else is a ValueError that says so. No torch import: arrays are duck-typed."""
import numbers
from collections.abc import Iterable

PROMPT_KINDS = ("a string, a list of token ids, a 1-D integer torch/numpy array, "
                "or a dict with 'prompt' or 'prompt_token_ids'")


def _is_token_id(x) -> bool:
    if type(x) is int:  # nearly every id: the ABC check below costs ~1 us a token
        return True
    # numpy / torch integer scalars count; bools (and numpy bools) never do
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and type(x).__name__ != "bool_"


def _is_array(x) -> bool:
    return hasattr(x, "tolist") and hasattr(x, "ndim") and not isinstance(x, (str, bytes))


def is_single_prompt(x) -> bool:
    """True for one prompt (as opposed to a collection of prompts)."""
    if isinstance(x, (str, dict)):
        return True
    if _is_array(x):
        return x.ndim == 1
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(_is_token_id(t) for t in x)


def prompt_list(prompts) -> list:
    """generate()'s prompts as a list: one prompt, or every prompt of an iterable (generators included)."""
    if is_single_prompt(prompts):
        return [prompts]
    if prompts is None or isinstance(prompts, bytes) or not isinstance(prompts, Iterable):
        raise ValueError(f"prompts must be a prompt or an iterable of prompts (a prompt is {PROMPT_KINDS}); "
                         f"got {type(prompts).__name__}")
    return list(prompts)


def per_prompt(value, num_prompts: int, name: str) -> list:
    """An argument given once for every prompt, or as a list or tuple of one per prompt: one per prompt."""
    if not isinstance(value, (list, tuple)):
        return [value] * num_prompts
    if len(value) != num_prompts:
        raise ValueError(f"got {len(value)} {name} for {num_prompts} prompts")
    return list(value)


def encode_text(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """The tokenizer's ids for a text prompt, BOS at most once: a tokenizer that adds BOS would double it
    in a prompt that already starts with it (text rendered from a chat template, say). add_special_tokens=False:
    the text's own tokens alone (vLLM's request field of that name)."""
    token_ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    bos = tokenizer.bos_token_id
    if add_special_tokens and bos is not None and token_ids[:2] == [bos, bos]:
        del token_ids[0]
    return token_ids


def images_of(prompt) -> list:
    """The images of a prompt dict's multi_modal_data ({"image": one image or a list}), in order; [] for any
    other prompt."""
    if not isinstance(prompt, dict) or prompt.get("multi_modal_data") is None:
        return []
    data = prompt["multi_modal_data"]
    if not isinstance(data, dict):
        raise ValueError(f"multi_modal_data must be a dict such as {{'image': image}}, got {type(data).__name__}")
    if set(data) - {"image"}:
        raise ValueError(f"multi_modal_data: {sorted(set(data) - {'image'})} not supported: images are the one "
                         "modality (video and audio are not)")
    images = data.get("image")
    return list(images) if isinstance(images, (list, tuple)) else [] if images is None else [images]


def parse_prompt(prompt, tokenizer) -> tuple[str | list[int], list[int]]:
    """(the prompt as RequestOutput reports it, its token ids); the ids are not yet checked against the vocabulary."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            prompt = prompt["prompt_token_ids"]
            if isinstance(prompt, str):
                raise ValueError(f"'prompt_token_ids' must be token ids, got a string {prompt!r}")
        elif "prompt" in prompt and isinstance(prompt["prompt"], str):
            prompt = prompt["prompt"]
        else:
            raise ValueError(f"a prompt dict needs 'prompt' (a string) or 'prompt_token_ids'; got keys {list(prompt)}")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this model folder has no tokenizer: pass prompts as lists of token ids")
        return prompt, encode_text(tokenizer, prompt)
    if _is_array(prompt):
        if prompt.ndim != 1:
            raise ValueError(f"a token-id array prompt must be 1-D, got {prompt.ndim} dimensions")
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        raise ValueError(f"a prompt must be {PROMPT_KINDS}; got {type(prompt).__name__} {prompt!r:.60}")
    if all(type(t) is int for t in prompt):  # nearly every prompt: no per-token check of the kinds below
        token_ids = list(prompt)
        return token_ids, token_ids
    for t in prompt:
        if not _is_token_id(t):
            raise ValueError(f"prompt token ids must be integers, got {t!r} ({type(t).__name__}); "
                             f"a prompt must be {PROMPT_KINDS}")
    token_ids = [int(t) for t in prompt]
    return token_ids, token_ids
