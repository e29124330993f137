"""Qwen3-VL's vision encoder (tpengine/models/qwen3_vl_vision.py) gives transformers' Qwen3VLVisionModel outputs,
the merged rows (pooler_output) and every deepstack feature (deepstack_features), for a tiny random tower: one
image on the learned position grid's own size, two images of different sizes in one call, frames whose sides
differ from the position grid's (the bilinear resampling matters), a two-frame video; loaded from the relative
names and from the `model.visual.` / `visual.` prefixed ones. At tp 2, two real rank processes (gloo) each load
their shard of the same tensors and both end with transformers' outputs. A vision_config value it cannot run is a
ValueError naming it."""
import functools

import pytest
import torch

from tests.models.vision import end_rank, outputs_of_two_ranks, start_rank
from tpengine.distributed.parallel_state import TensorParallelGroup, building_model_for
from tpengine.layers.linear import FUSED
from tpengine.models.qwen3_vl_vision import (Qwen3VLVisionSettings, Qwen3VLVisionTransformer, load_vision_weights,
                                             position_interpolation)

# the learned position grid is 8 x 8; deepstack features after blocks 0 and 2
TINY = dict(depth=4, hidden_size=64, intermediate_size=96, num_heads=4, patch_size=16, spatial_merge_size=2,
            temporal_patch_size=2, out_hidden_size=48, num_position_embeddings=64, deepstack_visual_indexes=[0, 2])
PATCH_FEATURES = 3 * 2 * 16 * 16
GRIDS = {
    "one_image_on_the_position_grid": [(1, 8, 8)],
    "two_sizes": [(1, 8, 12), (1, 4, 6)],
    "sides_off_the_position_grid": [(1, 6, 10)],
    "finer_than_the_position_grid": [(1, 14, 2)],
    "video_two_frames": [(2, 4, 8)],
}


@functools.lru_cache(maxsize=None)
def reference(deepstack: tuple[int, ...] = (0, 2)) -> tuple:
    """transformers' tower (float32, eval) with random weights, norms around 1, biases and pos_embed nonzero; its
    settings."""
    from transformers import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
    config = Qwen3VLVisionConfig(**{**TINY, "deepstack_visual_indexes": list(deepstack)})
    torch.manual_seed(0)
    model = Qwen3VLVisionModel._from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            is_norm_weight = "norm" in name and name.endswith("weight")
            param.copy_(torch.randn_like(param) * (0.5 if "pos_embed" in name else 0.1)
                        + (1.0 if is_norm_weight else 0.0))
    return model, Qwen3VLVisionSettings.from_dict(config.to_dict())


def pixels(grid: list[tuple[int, int, int]], seed: int = 1) -> torch.Tensor:
    rows = sum(t * h * w for t, h, w in grid)
    return torch.randn(rows, PATCH_FEATURES, generator=torch.Generator().manual_seed(seed))


def expected(grid: list[tuple[int, int, int]], deepstack: tuple[int, ...] = (0, 2)) -> tuple:
    model, _ = reference(deepstack)
    with torch.no_grad():
        out = model(pixels(grid), torch.tensor(grid))
    return out.pooler_output, out.deepstack_features


def assert_close_to(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    scale = theirs.abs().max().item()
    assert scale > 0.5  # a real signal, not zeros
    assert (ours - theirs).abs().max().item() < 1e-5 * scale


def assert_outputs_match(out: tuple, theirs: tuple) -> None:
    merged, deepstack = out
    assert_close_to(merged, theirs[0])
    assert len(deepstack) == len(theirs[1])
    for ours_feature, their_feature in zip(deepstack, theirs[1]):
        assert_close_to(ours_feature, their_feature)


def ours(tensors: dict[str, torch.Tensor] | None = None, deepstack: tuple[int, ...] = (0, 2)):
    model, settings = reference(deepstack)
    module = Qwen3VLVisionTransformer(settings)
    load_vision_weights(module, model.state_dict() if tensors is None else tensors)
    return module


@pytest.mark.parametrize("case", list(GRIDS))
def test_outputs_match_transformers_pooler_output_and_deepstack_features(case):
    grid = GRIDS[case]
    with torch.no_grad():
        merged, deepstack = ours()(pixels(grid), grid)
    rows = sum(t * h * w for t, h, w in grid) // 4
    assert merged.shape == (rows, TINY["out_hidden_size"]) and len(deepstack) == 2
    assert all(feature.shape == (rows, TINY["out_hidden_size"]) for feature in deepstack)
    assert_outputs_match((merged, deepstack), expected(grid))


def test_deepstack_features_come_in_block_order_each_from_its_own_merger():
    # indexes listed out of order: transformers pairs the i-th index with the i-th merger, returns block order
    grid = GRIDS["two_sizes"]
    with torch.no_grad():
        out = ours(deepstack=(3, 1))(pixels(grid), grid)
    assert_outputs_match(out, expected(grid, deepstack=(3, 1)))


def test_position_weights_are_transformers_and_matter():
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights
    grid = GRIDS["sides_off_the_position_grid"] + GRIDS["two_sizes"] + GRIDS["video_two_frames"]
    indices, weights = position_interpolation(grid, 2, 8)
    their_indices, their_weights = get_vision_interpolation_indices_and_weights(
        torch.tensor(grid), num_grid_per_side=8, mode="bilinear", align_corners=True, spatial_merge_size=2)
    assert torch.equal(indices, their_indices) and torch.equal(weights, their_weights)
    # off the grid's size, a patch mixes neighbouring grid points; on it, each takes exactly one
    assert (weights[:60] > 0).sum(1).max() == 4
    _, on_grid_weights = position_interpolation([(1, 8, 8)], 2, 8)
    assert torch.equal(on_grid_weights.max(1).values, torch.ones(64))


@pytest.mark.parametrize("prefix", ["model.visual.", "visual."])
def test_prefixed_checkpoint_names_load_and_the_language_model_s_are_skipped(prefix):
    model, _ = reference()
    tensors = {prefix + name: t for name, t in model.state_dict().items()}
    tensors["model.language_model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    tensors["lm_head.weight"] = torch.zeros(3, 3)
    grid = GRIDS["two_sizes"]
    with torch.no_grad():
        assert_outputs_match(ours(tensors)(pixels(grid), grid), expected(grid))


def test_checkpoint_names_map_to_our_parameters_and_shard_ids():
    module = ours()
    target = module.checkpoint_target
    assert target("blocks.0.attn.qkv.weight") == ("blocks.0.attn.qkv.weight", (FUSED,))
    assert target("model.visual.blocks.2.attn.qkv.bias") == ("blocks.2.attn.qkv.bias", (FUSED,))
    assert target("visual.blocks.1.attn.proj.weight") == ("blocks.1.attn.proj.weight", ())
    assert target("blocks.1.mlp.linear_fc1.bias") == ("blocks.1.mlp.linear_fc1.bias", ())
    assert target("blocks.3.norm2.bias") == ("blocks.3.norm2.bias", ())
    assert target("patch_embed.proj.bias") == ("patch_embed.proj.bias", ())
    assert target("model.visual.pos_embed.weight") == ("pos_embed.weight", ())
    assert target("merger.linear_fc1.weight") == ("merger.linear_fc1.weight", ())
    assert target("deepstack_merger_list.0.norm.weight") == ("deepstack_merger_list.0.norm.weight", ())
    assert target("model.language_model.layers.0.self_attn.q_proj.weight") == (None, ())
    assert target("rotary_pos_emb.inv_freq") == (None, ())
    # every tensor of transformers' state dict has a parameter of its shape at tp 1 (the Conv3d kernel flattened)
    params = dict(module.named_parameters())
    for name, tensor in reference()[0].state_dict().items():
        param = params[module.checkpoint_target(name)[0]]
        assert param.shape == (tensor.flatten(1) if name == "patch_embed.proj.weight" else tensor).shape
    kernel = reference()[0].state_dict()["patch_embed.proj.weight"]
    assert torch.equal(module.patch_embed.proj.weight, kernel.reshape(TINY["hidden_size"], -1))


def test_a_missing_or_misshapen_tensor_is_named():
    state = reference()[0].state_dict()
    missing = {k: v for k, v in state.items() if k != "deepstack_merger_list.1.norm.bias"}
    with pytest.raises(ValueError, match=r"deepstack_merger_list\.1\.norm\.bias"):
        ours(missing)
    misshapen = dict(state, **{"pos_embed.weight": torch.zeros(49, 64)})
    with pytest.raises(ValueError, match=r"pos_embed\.weight"):
        ours(misshapen)


@pytest.mark.parametrize("change, named", [
    ({"num_heads": 5}, "num_heads"),  # 64 not divisible by 5
    ({"hidden_act": "relu6"}, "hidden_act"),
    ({"deepstack_visual_indexes": [1, 4]}, "deepstack_visual_indexes"),  # block 4 of 4
    ({"deepstack_visual_indexes": [1, 1]}, "deepstack_visual_indexes"),
    ({"num_position_embeddings": 0}, "num_position_embeddings"),
    ({"patch_size": [16, 16]}, "patch_size"),
    ({"out_hidden_size": -1}, "out_hidden_size"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}, "rope_type"),
])
def test_a_setting_it_cannot_run_is_a_value_error_naming_it(change, named):
    with pytest.raises(ValueError, match=named):
        Qwen3VLVisionSettings.from_dict({**TINY, **change})


def test_settings_read_an_hf_json_vision_config_and_default_as_transformers():
    from transformers import Qwen3VLVisionConfig
    # Qwen3-VL-8B's vision_config, as its config.json writes it
    settings = Qwen3VLVisionSettings.from_dict({
        "deepstack_visual_indexes": [8, 16, 24], "depth": 27, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152,
        "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4304, "model_type": "qwen3_vl",
        "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 4096, "patch_size": 16,
        "spatial_merge_size": 2, "temporal_patch_size": 2})
    assert (settings.head_dim, settings.grid_side, settings.deepstack_visual_indexes) == (72, 48, (8, 16, 24))
    defaults = Qwen3VLVisionConfig().to_dict()
    assert Qwen3VLVisionSettings.from_dict({}) == Qwen3VLVisionSettings.from_dict(defaults)


def test_bad_inputs_are_value_errors():
    module = ours()
    with pytest.raises(ValueError, match="spatial_merge_size"):
        module(pixels([(1, 5, 6)]), [(1, 5, 6)])
    with pytest.raises(ValueError, match="pixel_values"):
        module(pixels([(1, 4, 6)]), [(1, 4, 8)])


def test_tensor_parallel_size_must_divide_the_heads():
    group = TensorParallelGroup(0, 3, process_group=object())  # a stand-in: nothing runs
    with building_model_for(group), pytest.raises(ValueError, match="num_heads"):
        Qwen3VLVisionTransformer(reference()[1])


# --- tp 2: two real ranks ------------------------------------------------------------------------------------

def run_rank(rank: int, size: int, port: int, inputs: str, outputs: str) -> None:
    """One rank: its shard of the tower, loaded from the whole tensors, run on every grid; its outputs saved."""
    data = torch.load(inputs)
    store, group = start_rank(rank, size, port)
    with building_model_for(group):
        module = Qwen3VLVisionTransformer(Qwen3VLVisionSettings.from_dict(data["settings"]))
    load_vision_weights(module, data["tensors"])
    qkv = data["tensors"]["blocks.0.attn.qkv.weight"]
    # this rank's 2 of 4 heads of each of q, k and v; half of each deepstack merger's fc1 rows
    assert torch.equal(module.blocks[0].attn.qkv.weight, torch.cat([p.chunk(size)[rank] for p in qkv.chunk(3)]))
    fc1 = data["tensors"]["deepstack_merger_list.1.linear_fc1.weight"]
    assert torch.equal(module.deepstack_merger_list[1].linear_fc1.weight, fc1.chunk(size)[rank])
    with torch.no_grad():
        results = [module(pixel_values, grid) for pixel_values, grid in data["inputs"]]
    torch.save(results, f"{outputs}.{rank}")
    end_rank(store, group, rank, size)


def test_two_ranks_each_end_with_transformers_outputs(tmp_path):
    model, _ = reference()
    grids = [GRIDS["two_sizes"], GRIDS["sides_off_the_position_grid"]]
    data = {"settings": dict(TINY), "tensors": model.state_dict(), "inputs": [(pixels(grid), grid) for grid in grids]}
    for outputs in outputs_of_two_ranks(run_rank, data, tmp_path):
        for out, grid in zip(outputs, grids):
            assert_outputs_match(out, expected(grid))
