"""Qwen2.5-VL: Qwen2's decoder (bias on q, k and v) rotated by M-RoPE, reading images through its vision tower.

    image patches -> vision tower (models/qwen2_5_vl_vision.py) -> one vector per 2x2 merged patch
    prompt tokens -> embedding, each image placeholder's row replaced by its image's vector
                  -> N x [RMSNorm -> attention with M-RoPE -> RMSNorm -> gated SiLU MLP] -> RMSNorm -> LM head

M-RoPE (layers/mrope.py) turns each rotary frequency by one of three positions: temporal, height, width. Text
tokens have the three alike; an image's tokens take their patch's row and column (multimodal/mrope_positions.py),
and the tokens after it continue from the largest, so a generated token's position is its index plus a per-prompt
delta. Both towers are sharded over the tensor-parallel group; the tower runs on the first pipeline stage's ranks.

transformers 5 keeps the weights under model.language_model. and model.visual., transformers 4 under model. and
visual.; both load.
"""
import torch

from tpengine.families import FAMILIES
from tpengine.hf_config import HFConfig, head_dim_of, max_positions_of, mrope_section_of, rope_parameters_of
from tpengine.layers.mrope import get_mrope
from tpengine.models.decoder import (DecoderAttention, DecoderFamily, DecoderForCausalLM, DecoderLayer,
                                     ImageTextCheckpoint)
from tpengine.models.qwen2_5_vl_vision import Qwen2_5_VisionTransformer, Qwen2_5_VLVisionSettings


class MRopeAttention(DecoderAttention):
    """The decoder's attention, its rotary embedding M-RoPE's (sections contiguous or interleaved, as the family's)."""

    def __init__(self, config: HFConfig, family: DecoderFamily, backend, layer_idx: int):
        super().__init__(config, family, backend, layer_idx)
        self.rotary_emb = get_mrope(head_dim_of(config), max_positions_of(config),
                                    rope_parameters_of(config, layer_idx), mrope_section_of(config),
                                    FAMILIES[config.model_type].mrope_interleaved)


class MRopeDecoderLayer(DecoderLayer):
    attention_class = MRopeAttention


class Qwen2_5_VLForConditionalGeneration(ImageTextCheckpoint, DecoderForCausalLM):
    layer_class = MRopeDecoderLayer
    vision_settings, vision_tower = Qwen2_5_VLVisionSettings, Qwen2_5_VisionTransformer

    # checkpoint prefix -> ours, first match wins (transformers 5's names, then transformers 4's)
    text_prefixes = {"model.language_model.": "model.", "lm_head.": "lm_head.", "model.": "model."}
    vision_prefixes = {"model.visual.": "", "visual.": ""}

    def __init__(self, config: HFConfig, backend):
        super().__init__(config, backend)
        if config.vision_config is None:
            raise ValueError("an image-text checkpoint's config.json needs vision_config")
        settings = self.vision_settings.from_dict(config.vision_config)
        if settings.out_hidden_size != config.hidden_size:
            raise ValueError(f"vision_config.out_hidden_size={settings.out_hidden_size} must equal the text model's "
                             f"hidden_size={config.hidden_size}")
        self.hidden_size = config.hidden_size
        self.visual = self.vision_tower(settings) if self.stage.is_first else None

    @staticmethod
    def family(config: HFConfig) -> DecoderFamily:
        return DecoderFamily(qkv_bias=True)

    def encode_images(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """[placeholder tokens of every image, hidden]: the images' patch rows (the processor's, in order) through
        the vision tower, one vector per merged patch."""
        return self.visual(pixel_values, grids)

