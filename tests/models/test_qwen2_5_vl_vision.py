"""Qwen2.5-VL's vision encoder (tpengine/models/qwen2_5_vl_vision.py) gives transformers' pooler_output for a tiny
random tower: one image, two of different sizes in one call, a frame whose sides are not multiples of the window,
a two-frame video; loaded from the relative names and from the `model.visual.` / `visual.` prefixed ones. At tp 2,
two real rank processes (gloo) each load their shard of the same tensors and both end with transformers' output.
A vision_config value it cannot run is a ValueError naming it."""
import functools

import pytest
import torch

from tests.models.vision import end_rank, outputs_of_two_ranks, start_rank
from tpengine.distributed.parallel_state import TensorParallelGroup, building_model_for
from tpengine.layers.linear import FUSED
from tpengine.models.qwen2_5_vl_vision import (Qwen2_5_VisionTransformer, Qwen2_5_VLVisionSettings,
                                               load_vision_weights)

# window 56 = 2 x 2 merged patches of 2 x 2 patches: a (1, 8, 12) frame is 2 x 3 windows; blocks 1 and 3 see whole
# frames
TINY = dict(depth=4, hidden_size=64, intermediate_size=96, num_heads=4, patch_size=14, spatial_merge_size=2,
            temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1, 3], out_hidden_size=48)
PATCH_FEATURES = 3 * 2 * 14 * 14
GRIDS = {
    "one_image": [(1, 8, 12)],
    "two_sizes": [(1, 8, 12), (1, 4, 6)],
    "windows_cut_at_the_edge": [(1, 10, 6)],
    "video_two_frames": [(2, 4, 8)],
}


@functools.lru_cache(maxsize=None)
def reference() -> tuple:
    """transformers' tower (float32, eval) with random weights, norms around 1, biases nonzero; its settings."""
    from transformers import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
    config = Qwen2_5_VLVisionConfig(**TINY)
    torch.manual_seed(0)
    model = Qwen2_5_VisionTransformerPretrainedModel._from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            is_norm = "norm" in name or "ln_q" in name
            param.copy_(torch.randn_like(param) * 0.1 + (1.0 if is_norm else 0.0))
    return model, Qwen2_5_VLVisionSettings.from_dict(config.to_dict())


def pixels(grid: list[tuple[int, int, int]], seed: int = 1) -> torch.Tensor:
    rows = sum(t * h * w for t, h, w in grid)
    return torch.randn(rows, PATCH_FEATURES, generator=torch.Generator().manual_seed(seed))


def expected(grid: list[tuple[int, int, int]]) -> torch.Tensor:
    model, _ = reference()
    with torch.no_grad():
        return model(pixels(grid), torch.tensor(grid)).pooler_output


def assert_close_to(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    scale = theirs.abs().max().item()
    assert scale > 1.0  # a real signal, not zeros
    assert (ours - theirs).abs().max().item() < 1e-5 * scale


def ours(tensors: dict[str, torch.Tensor] | None = None) -> Qwen2_5_VisionTransformer:
    model, settings = reference()
    module = Qwen2_5_VisionTransformer(settings)
    load_vision_weights(module, model.state_dict() if tensors is None else tensors)
    return module


@pytest.mark.parametrize("case", list(GRIDS))
def test_output_matches_transformers_pooler_output(case):
    grid = GRIDS[case]
    with torch.no_grad():
        out = ours()(pixels(grid), grid)
    assert out.shape == (sum(t * h * w for t, h, w in grid) // 4, TINY["out_hidden_size"])
    assert_close_to(out, expected(grid))


@pytest.mark.parametrize("prefix", ["model.visual.", "visual."])
def test_prefixed_checkpoint_names_load_and_the_language_model_s_are_skipped(prefix):
    model, _ = reference()
    tensors = {prefix + name: t for name, t in model.state_dict().items()}
    tensors["model.language_model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    tensors["lm_head.weight"] = torch.zeros(3, 3)
    grid = GRIDS["two_sizes"]
    with torch.no_grad():
        assert_close_to(ours(tensors)(pixels(grid), grid), expected(grid))


def test_checkpoint_names_map_to_our_parameters_and_shard_ids():
    module = ours()
    target = module.checkpoint_target
    assert target("blocks.0.attn.qkv.weight") == ("blocks.0.attn.qkv.weight", (FUSED,))
    assert target("blocks.2.attn.qkv.bias") == ("blocks.2.attn.qkv.bias", (FUSED,))
    assert target("blocks.0.mlp.gate_proj.weight") == ("blocks.0.mlp.gate_up_proj.weight", (0,))
    assert target("model.visual.blocks.1.mlp.up_proj.bias") == ("blocks.1.mlp.gate_up_proj.bias", (1,))
    assert target("visual.blocks.1.mlp.down_proj.weight") == ("blocks.1.mlp.down_proj.weight", ())
    assert target("patch_embed.proj.weight") == ("patch_embed.proj.weight", ())
    assert target("merger.mlp.0.weight") == ("merger.mlp.0.weight", ())
    assert target("model.visual.merger.ln_q.weight") == ("merger.ln_q.weight", ())
    assert target("model.language_model.layers.0.self_attn.q_proj.weight") == (None, ())
    assert target("rotary_pos_emb.inv_freq") == (None, ())
    # the Conv3d kernel [embed, C, T, P, P] flattened as each patch row is
    kernel = reference()[0].state_dict()["patch_embed.proj.weight"]
    assert torch.equal(module.patch_embed.proj.weight, kernel.reshape(TINY["hidden_size"], -1))


def test_a_missing_or_misshapen_tensor_is_named():
    state = reference()[0].state_dict()
    missing = {k: v for k, v in state.items() if k != "blocks.2.norm2.weight"}
    with pytest.raises(ValueError, match=r"blocks\.2\.norm2\.weight"):
        ours(missing)
    misshapen = dict(state, **{"blocks.1.attn.qkv.weight": torch.zeros(3 * 64, 32)})
    with pytest.raises(ValueError, match=r"blocks\.1\.attn\.qkv\.weight"):
        ours(misshapen)


@pytest.mark.parametrize("change, named", [
    ({"num_heads": 5}, "num_heads"),  # 64 not divisible by 5
    ({"hidden_act": "relu6"}, "hidden_act"),
    ({"window_size": 20}, "window_size"),  # below one merged patch (28)
    ({"fullatt_block_indexes": [4]}, "fullatt_block_indexes"),
    ({"patch_size": [14, 14]}, "patch_size"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}, "rope_type"),
])
def test_a_setting_it_cannot_run_is_a_value_error_naming_it(change, named):
    with pytest.raises(ValueError, match=named):
        Qwen2_5_VLVisionSettings.from_dict({**TINY, **change})


def test_settings_read_an_hf_json_vision_config():
    # Qwen2.5-VL-7B's vision_config, as its config.json writes it (in_chans, no in_channels)
    settings = Qwen2_5_VLVisionSettings.from_dict({
        "depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
        "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14,
        "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
        "temporal_patch_size": 2})
    assert (settings.in_channels, settings.head_dim, settings.merger_window) == (3, 80, 4)
    assert settings.fullatt_block_indexes == (7, 15, 23, 31) and settings.rms_norm_eps == 1e-6


def test_bad_inputs_are_value_errors():
    module = ours()
    with pytest.raises(ValueError, match="spatial_merge_size"):
        module(pixels([(1, 5, 6)]), [(1, 5, 6)])
    with pytest.raises(ValueError, match="pixel_values"):
        module(pixels([(1, 4, 6)]), [(1, 4, 8)])
    with pytest.raises(ValueError, match="grid_thw is empty"):
        module(torch.zeros(0, PATCH_FEATURES), [])


def test_tensor_parallel_size_must_divide_the_heads():
    group = TensorParallelGroup(0, 3, process_group=object())  # a stand-in: nothing runs
    with building_model_for(group), pytest.raises(ValueError, match="num_heads"):
        Qwen2_5_VisionTransformer(reference()[1])


# --- tp 2: two real ranks ------------------------------------------------------------------------------------

def run_rank(rank: int, size: int, port: int, inputs: str, outputs: str) -> None:
    """One rank: its shard of the tower, loaded from the whole tensors, run on every grid; its outputs saved."""
    data = torch.load(inputs)
    store, group = start_rank(rank, size, port)
    with building_model_for(group):
        module = Qwen2_5_VisionTransformer(Qwen2_5_VLVisionSettings.from_dict(data["settings"]))
    load_vision_weights(module, data["tensors"])
    qkv = data["tensors"]["blocks.0.attn.qkv.weight"]
    # this rank's 2 of 4 heads of each of q, k and v
    assert torch.equal(module.blocks[0].attn.qkv.weight, torch.cat([p.chunk(size)[rank] for p in qkv.chunk(3)]))
    with torch.no_grad():
        results = [module(pixel_values, grid) for pixel_values, grid in data["inputs"]]
    torch.save(results, f"{outputs}.{rank}")
    end_rank(store, group, rank, size)


def test_two_ranks_each_end_with_transformers_output(tmp_path):
    model, _ = reference()
    grids = [GRIDS["two_sizes"], GRIDS["windows_cut_at_the_edge"]]
    data = {"settings": dict(TINY), "tensors": model.state_dict(), "inputs": [(pixels(grid), grid) for grid in grids]}
    for outputs in outputs_of_two_ranks(run_rank, data, tmp_path):
        for out, grid in zip(outputs, grids):
            assert_close_to(out, expected(grid))
