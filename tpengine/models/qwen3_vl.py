"""Qwen3-VL (dense): Qwen3's decoder (RMSNorm on each head's q and k) rotated by interleaved M-RoPE, reading images
through its vision tower, whose earlier layers feed the first decoder layers too (deepstack).

    image patches -> vision tower (models/qwen3_vl_vision.py) -> one vector per 2x2 merged patch, and one more per
                     deepstack layer of the tower
    prompt tokens -> embedding, each image placeholder's row replaced by its image's vector
                  -> layer 0 .. N-1, after layer i < len(deepstack): the image rows add the tower's i-th deepstack
                     vectors -> RMSNorm -> LM head

Interleaved M-RoPE turns frequency j by the temporal, height or width position as j mod 3 says (within the height
and width sections), where Qwen2.5-VL gives each position a contiguous section. The positions themselves are
Qwen2.5-VL's (multimodal/mrope_positions.py). transformers 5 keeps the weights under model.language_model. and
model.visual.
"""
import torch

from tpengine.attention.metadata import AttentionMetadata
from tpengine.hf_config import HFConfig
from tpengine.models.decoder import DecoderFamily, DecoderModel
from tpengine.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from tpengine.models.qwen3_vl_vision import Qwen3VLVisionSettings, Qwen3VLVisionTransformer


class DeepstackDecoderModel(DecoderModel):
    def forward_with_deepstack(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                               rows: torch.Tensor, embeddings: torch.Tensor,
                               deepstack: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The final hidden states of a step whose rows `rows` read image embeddings; after layer i the image rows
        add deepstack[i] (transformers adds it to the layer's output; here to the residual stream the next layer
        adds that output to: the same sum)."""
        hidden_states = self.embed_tokens(input_ids)
        hidden_states = hidden_states.index_copy(0, rows, embeddings.to(hidden_states.dtype))
        residual = None
        for i, layer in enumerate(self.layers):
            hidden_states, residual = layer(positions, hidden_states, residual, meta)
            if i < len(deepstack):
                residual = residual.index_add(0, rows, deepstack[i].to(residual.dtype))
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Qwen3VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    model_class = DeepstackDecoderModel
    vision_settings, vision_tower = Qwen3VLVisionSettings, Qwen3VLVisionTransformer

    @staticmethod
    def family(config: HFConfig) -> DecoderFamily:
        return DecoderFamily(qkv_bias=config.attention_bias, o_bias=config.attention_bias, qk_norm=True)

    def forward(self, input_ids, positions, meta: AttentionMetadata, from_previous_stage: torch.Tensor | None = None,
                replaced_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        if replaced_embeddings is None:
            return self.model(input_ids, positions, meta, from_previous_stage)
        rows, vectors = replaced_embeddings  # each image row's embedding, then its deepstack vectors, side by side
        embeddings, *deepstack = vectors.split(self.hidden_size, dim=1)
        return self.model.forward_with_deepstack(input_ids, positions, meta, rows, embeddings, tuple(deepstack))

    def encode_images(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """[placeholder tokens of every image, hidden * (1 + deepstack layers)]: each merged patch's embedding and
        its deepstack vectors side by side, so a rank keeps and slices them as one tensor."""
        embeddings, deepstack = self.visual(pixel_values, grids)
        return torch.cat([embeddings, *deepstack], dim=1)
