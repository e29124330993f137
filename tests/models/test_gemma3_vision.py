"""Gemma 3's vision tower and projector (tpengine/models/gemma3_vision.py) give transformers' image features
(Gemma3Model.get_image_features(pixel_values).pooler_output) for a tiny random Gemma3ForConditionalGeneration: two
images in one call, pooled 2 x 2 and not pooled at all; loaded from transformers 5's names
(`model.vision_tower.`), from what its save_pretrained writes (`vision_tower.`) and from the released checkpoints'
(`vision_tower.vision_model.`).
At tp 2, two real rank processes (gloo) each load their shard of the same tensors and both end with transformers'
output. A config value it cannot run is a ValueError naming it."""
import dataclasses
import functools

import pytest
import torch

from tests.models.vision import end_rank, outputs_of_two_ranks, start_rank
from tpengine.distributed.parallel_state import TensorParallelGroup, building_model_for
from tpengine.models.gemma3_vision import Gemma3VisionSettings, Gemma3VisionTower, load_vision_weights

# 4 x 4 patches of 8 pixels per image; 4 heads of 8 so that tp 2 splits them
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, image_size=32,
              patch_size=8, vision_use_head=False, model_type="siglip_vision_model")
TEXT = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            head_dim=32, vocab_size=300)
TEXT_HIDDEN = 64


@functools.lru_cache(maxsize=None)
def reference(mm_tokens_per_image: int = 4):
    """transformers' whole model (float32, eval) with random weights: norms around their identity, biases nonzero."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    config = Gemma3Config(text_config=TEXT, vision_config=VISION, mm_tokens_per_image=mm_tokens_per_image,
                          boi_token_index=297, eoi_token_index=298, image_token_index=299)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.model.named_parameters():
            if "language_model" in name:
                continue
            # LayerNorm weights around 1; the Gemma RMSNorm's is stored as w in x * (1 + w), so around 0
            around_one = "layer_norm" in name and name.endswith("weight")
            param.copy_(torch.randn_like(param) * (0.5 if "embedding" in name else 0.1) + (1.0 if around_one else 0.0))
    return model


def vision_tensors(mm_tokens_per_image: int = 4) -> dict[str, torch.Tensor]:
    """The vision tower's and projector's tensors by transformers 5's in-memory names (`model.vision_tower.`)."""
    return {name: t for name, t in reference(mm_tokens_per_image).state_dict().items()
            if name.startswith(("model.vision_tower.", "model.multi_modal_projector."))}


def settings_for(mm_tokens_per_image: int = 4) -> Gemma3VisionSettings:
    return Gemma3VisionSettings.from_config(VISION, mm_tokens_per_image, TEXT_HIDDEN)


def images(count: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randn(count, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def expected(mm_tokens_per_image: int = 4) -> torch.Tensor:
    with torch.no_grad():
        features = reference(mm_tokens_per_image).model.get_image_features(images()).pooler_output
    return features.reshape(-1, TEXT_HIDDEN)


def assert_close_to(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    scale = theirs.abs().max().item()
    assert scale > 0.1  # a real signal, not zeros
    assert (ours - theirs).abs().max().item() < 1e-5 * max(scale, 1.0)


def ours(tensors: dict[str, torch.Tensor] | None = None, mm_tokens_per_image: int = 4) -> Gemma3VisionTower:
    tower = Gemma3VisionTower(settings_for(mm_tokens_per_image))
    load_vision_weights(tower, vision_tensors(mm_tokens_per_image) if tensors is None else tensors)
    return tower


@pytest.mark.parametrize("mm_tokens_per_image", [4, 16])  # 2 x 2 patches pooled per token; none pooled
def test_output_matches_transformers_image_features(mm_tokens_per_image):
    with torch.no_grad():
        out = ours(mm_tokens_per_image=mm_tokens_per_image)(images())
    assert out.shape == (2 * mm_tokens_per_image, TEXT_HIDDEN)
    assert_close_to(out, expected(mm_tokens_per_image))


def test_each_image_attends_only_within_itself():
    tower = ours()
    with torch.no_grad():
        both = tower(images())
        second_alone = tower(images()[1:])
    assert torch.allclose(both[4:], second_alone, atol=1e-6)


@pytest.mark.parametrize("rename", [
    lambda n: n.removeprefix("model."),  # what transformers 5's save_pretrained writes
    lambda n: n.removeprefix("model.").replace("vision_tower.", "vision_tower.vision_model."),  # the released ones
    lambda n: n.replace("vision_tower.", "vision_tower.vision_model."),
])
def test_checkpoint_names_of_each_layout_load_and_others_are_skipped(rename):
    tensors = {rename(name): t for name, t in vision_tensors().items()}
    tensors["language_model.model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    tensors["model.language_model.embed_tokens.weight"] = torch.zeros(3, 3)
    tensors["vision_tower.vision_model.head.probe"] = torch.zeros(1, 1, 32)  # a vision_use_head checkpoint's
    with torch.no_grad():
        assert_close_to(ours(tensors)(images()), expected())


def test_checkpoint_names_map_to_our_parameters_and_shard_ids():
    tower = ours()
    target = tower.checkpoint_target
    layer = "vision_tower.encoder.layers.1."
    assert target("model.vision_tower.encoder.layers.1.self_attn.q_proj.weight") == \
        (layer + "self_attn.qkv_proj.weight", ("q",))
    assert target("vision_tower.vision_model.encoder.layers.1.self_attn.v_proj.bias") == \
        (layer + "self_attn.qkv_proj.bias", ("v",))
    assert target("vision_tower.encoder.layers.1.self_attn.out_proj.weight") == \
        (layer + "self_attn.out_proj.weight", ())
    assert target("vision_tower.vision_model.encoder.layers.1.mlp.fc2.bias") == (layer + "mlp.fc2.bias", ())
    assert target("model.vision_tower.embeddings.patch_embedding.weight") == \
        ("vision_tower.embeddings.patch_embedding.weight", ())
    assert target("multi_modal_projector.mm_input_projection_weight") == \
        ("multi_modal_projector.mm_input_projection_weight", ())
    assert target("model.multi_modal_projector.mm_soft_emb_norm.weight") == \
        ("multi_modal_projector.mm_soft_emb_norm.weight", ())
    assert target("vision_tower.vision_model.head.attention.in_proj_weight") == (None, ())
    assert target("model.language_model.layers.0.self_attn.q_proj.weight") == (None, ())
    assert target("lm_head.weight") == (None, ())
    kernel = vision_tensors()["model.vision_tower.embeddings.patch_embedding.weight"]
    assert torch.equal(tower.vision_tower.embeddings.patch_embedding.weight, kernel.reshape(32, -1))


def test_a_missing_or_misshapen_tensor_is_named():
    state = vision_tensors()
    missing = {k: v for k, v in state.items() if k != "model.vision_tower.encoder.layers.1.self_attn.k_proj.weight"}
    with pytest.raises(ValueError, match=r"encoder\.layers\.1\.self_attn\.qkv_proj\.weight"):
        ours(missing)
    misshapen = dict(state, **{"model.vision_tower.embeddings.position_embedding.weight": torch.zeros(9, 32)})
    with pytest.raises(ValueError, match=r"position_embedding\.weight"):
        ours(misshapen)


@pytest.mark.parametrize("change, tokens, named", [
    ({"hidden_size": 0}, 4, "hidden_size"),
    ({"num_attention_heads": 5}, 4, "num_attention_heads"),  # 32 not divisible by 5
    ({"image_size": 36}, 4, "image_size"),  # 36 / 8
    ({"patch_size": [8, 8]}, 4, "patch_size"),
    ({"num_hidden_layers": -1}, 4, "num_hidden_layers"),
    ({}, 8, "mm_tokens_per_image=8"),  # not a square
    ({}, 9, "mm_tokens_per_image=9"),  # side 3 does not divide 4 patches per side
    ({}, 0, "mm_tokens_per_image"),
    ({"hidden_act": "relu6"}, 4, "hidden_act"),
    ({"layer_norm_eps": 0.0}, 4, "layer_norm_eps"),
])
def test_a_setting_it_cannot_run_is_a_value_error_naming_it(change, tokens, named):
    with pytest.raises(ValueError, match=named):
        Gemma3VisionSettings.from_config({**VISION, **change}, tokens, TEXT_HIDDEN)
    with pytest.raises(ValueError, match="text_hidden_size"):
        Gemma3VisionSettings.from_config(VISION, 4, 0)


def test_settings_default_as_a_gemma3_config_fills_its_vision_config():
    from transformers import Gemma3Config
    defaults = Gemma3Config(mm_tokens_per_image=196).vision_config.to_dict()  # 224 / 16 = 14 patches per side
    assert Gemma3VisionSettings.from_config({}, 196, 2560) == Gemma3VisionSettings.from_config(defaults, 196, 2560)
    # Gemma 3 4B's vision_config, as its config.json writes it: 64 x 64 patches pooled 4 x 4 into 256 tokens
    released = Gemma3VisionSettings.from_config({
        "hidden_size": 1152, "image_size": 896, "intermediate_size": 4304, "model_type": "siglip_vision_model",
        "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}, 256, 2560)
    assert (released.head_dim, released.patches_per_side, released.pool_kernel) == (72, 64, 4)


def test_bad_pixel_values_are_value_errors():
    tower = ours()
    with pytest.raises(ValueError, match="pixel_values"):
        tower(torch.zeros(2, 3, 32, 24))
    with pytest.raises(ValueError, match="pixel_values"):
        tower(torch.zeros(3, 32, 32))


def test_tensor_parallel_size_must_divide_the_heads():
    group = TensorParallelGroup(0, 3, process_group=object())  # a stand-in: nothing runs
    with building_model_for(group), pytest.raises(ValueError, match="num_attention_heads"):
        Gemma3VisionTower(settings_for())


# --- tp 2: two real ranks ------------------------------------------------------------------------------------

def run_rank(rank: int, size: int, port: int, inputs: str, outputs: str) -> None:
    """One rank: its shard of the tower, loaded from the whole tensors, run on the images; its output saved."""
    data = torch.load(inputs)
    store, group = start_rank(rank, size, port)
    with building_model_for(group):
        tower = Gemma3VisionTower(Gemma3VisionSettings(**data["settings"]))
    load_vision_weights(tower, data["tensors"])
    attention = tower.vision_tower.encoder.layers[0].self_attn
    prefix = "model.vision_tower.encoder.layers.0."
    # this rank's 2 of 4 heads of each of q, k and v; half of fc1's rows, half of fc2's columns
    qkv = [data["tensors"][f"{prefix}self_attn.{p}_proj.weight"].chunk(size)[rank] for p in "qkv"]
    assert torch.equal(attention.qkv_proj.weight, torch.cat(qkv))
    mlp = tower.vision_tower.encoder.layers[0].mlp
    assert torch.equal(mlp.fc1.weight, data["tensors"][f"{prefix}mlp.fc1.weight"].chunk(size)[rank])
    assert torch.equal(mlp.fc2.weight, data["tensors"][f"{prefix}mlp.fc2.weight"].chunk(size, dim=1)[rank])
    with torch.no_grad():
        torch.save(tower(data["images"]), f"{outputs}.{rank}")
    end_rank(store, group, rank, size)


def test_two_ranks_each_end_with_transformers_output(tmp_path):
    data = {"settings": dataclasses.asdict(settings_for()), "tensors": vision_tensors(), "images": images()}
    for outputs in outputs_of_two_ranks(run_rank, data, tmp_path):
        assert_close_to(outputs, expected())
