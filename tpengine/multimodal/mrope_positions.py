"""Multimodal rotary positions (M-RoPE) of a Qwen2.5-VL / Qwen3-VL prompt: three rows (temporal, height, width).

Equals transformers' get_rope_index (Qwen2_5_VLModel's and Qwen3VLModel's, identical for images) for a prompt
of text and images, no video: text tokens count on from where the last token left off, the same on all three
rows; an image of llm grid (t, h', w') = (t, h // m, w // m) starting at position s gets temporal s + frame,
height s + row and width s + column, and the text after it resumes at s + max(h', w') (transformers advances
by that alone, whatever t is). The delta is mrope_position_deltas: a generated token at sequence index i has
all three positions i + delta. Pure numpy: the scheduler process computes it and never touches tensors.
"""
import numpy as np

Grid = tuple[int, int, int]


def image_runs(token_ids: np.ndarray, image_token_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) of each maximal run of image_token_id in token_ids, in order."""
    is_image = np.concatenate([[0], (token_ids == image_token_id).astype(np.int8), [0]])
    edges = np.diff(is_image)
    return np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)


def _llm_grids(image_grids: list[Grid], spatial_merge_size: int) -> list[Grid]:
    # the language model sees each image after the vision tower merges m x m patches into one token
    m = spatial_merge_size
    return [(int(t), int(h) // m, int(w) // m) for t, h, w in image_grids]


def _brief(items: list) -> str:
    # a stray image token in a long prompt can make hundreds of runs: name the first few
    return str(items) if len(items) <= 8 else f"[{', '.join(map(str, items[:8]))}, ... ({len(items)} in all)]"


def _check_runs(starts: np.ndarray, ends: np.ndarray, image_grids: list[Grid], llm_grids: list[Grid],
                image_token_id: int, spatial_merge_size: int) -> None:
    found = (ends - starts).tolist()
    expected = [t * h * w for t, h, w in llm_grids]
    if found != expected:
        raise ValueError(
            f"the prompt has {len(found)} run(s) of image token {image_token_id} of lengths {_brief(found)}, but "
            f"image_grids {_brief([tuple(map(int, g)) for g in image_grids])} (spatial_merge_size "
            f"{spatial_merge_size}) expect {len(expected)} image(s) of lengths {_brief(expected)}")


def _image_positions(start: int, grid: Grid) -> np.ndarray:
    """[3, t * h * w] positions of one image (llm grid) whose first token sits at position start."""
    t, h, w = grid
    frames = np.repeat(np.arange(t, dtype=np.int64), h * w)
    rows = np.tile(np.repeat(np.arange(h, dtype=np.int64), w), t)
    columns = np.tile(np.arange(w, dtype=np.int64), t * h)
    return np.stack([frames, rows, columns]) + start


def mrope_positions(token_ids: list[int], image_grids: list[Grid], image_token_id: int,
                    spatial_merge_size: int) -> tuple[np.ndarray, int]:
    """(positions int64 [3, len(token_ids)], delta): the prompt's temporal/height/width positions, and what a
    generated token adds to its sequence index. Each image is a run of t * (h // m) * (w // m) image tokens,
    in image_grids' order (the processor's image_grid_thw, in patches); ValueError when the runs do not match."""
    ids = np.asarray(token_ids, dtype=np.int64)
    starts, ends = image_runs(ids, image_token_id)
    llm_grids = _llm_grids(image_grids, spatial_merge_size)
    _check_runs(starts, ends, image_grids, llm_grids, image_token_id, spatial_merge_size)
    positions = np.broadcast_to(np.arange(len(ids), dtype=np.int64), (3, len(ids))).copy()
    shift, text_start = 0, 0  # position minus sequence index: each image moves it by max(h', w') - its length
    for start, end, grid in zip(starts.tolist(), ends.tolist(), llm_grids):
        positions[:, text_start:start] += shift
        positions[:, start:end] = _image_positions(start + shift, grid)
        shift, text_start = shift + max(grid[1], grid[2]) - (end - start), end
    positions[:, text_start:] += shift
    delta = int(positions.max()) + 1 - len(ids) if len(ids) else 0
    return positions, delta
