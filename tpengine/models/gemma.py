"""Gemma 2 and Gemma 3 (its text model): the shared decoder with Gemma's norms and scales.

    embed * sqrt(hidden) -> N x [norm -> attention -> norm -> + residual
                                 norm -> GeGLU MLP  -> norm -> + residual] -> norm -> LM head (tied)

Every norm is Gemma's RMSNorm, x normed times (1 + weight) in float32. The MLP is gated by GELU with the tanh
approximation. Attention scores scale by query_pre_attn_scalar ** -0.5, not head_dim's. Layers alternate
between a sliding window and full attention as layer_types says (Gemma 2: every other layer; Gemma 3: five
sliding to one full).

Gemma 2 soft-caps the attention scores (attn_logit_softcapping) and the final logits
(final_logit_softcapping): c * tanh(x / c). Gemma 3 instead norms each head's queries and keys (Gemma's
RMSNorm) before the rotary embedding, gives its sliding layers their own rope base (rope_parameters per layer
type), and caps only the final logits, where its config sets a cap: transformers' Gemma 3 ignores
attn_logit_softcapping, and its Gemma3ForConditionalGeneration caps no logits at all. All as transformers
5.24 computes them (modeling_gemma2.py, modeling_gemma3.py).
"""
import torch
from torch import nn

from tpengine.attention.metadata import AttentionMetadata
from tpengine.hf_config import HFConfig
from tpengine.layers.activation import GeluTanhAndMul
from tpengine.layers.layernorm import GemmaRMSNorm
from tpengine.models.decoder import DecoderFamily, DecoderForCausalLM, DecoderLayer, ImageTextCheckpoint
from tpengine.models.gemma3_vision import Gemma3VisionSettings, Gemma3VisionTower


class GemmaDecoderLayer(DecoderLayer):
    """Norms before and after both attention and MLP; the residual adds the post-normed output."""

    def __init__(self, config: HFConfig, family: DecoderFamily, backend, mlp: nn.Module, layer_idx: int):
        super().__init__(config, family, backend, mlp, layer_idx)
        self.pre_feedforward_layernorm = family.norm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = family.norm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata):
        """(the MLP's post-normed output, the residual stream it is still to be added to)."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.post_attention_layernorm(self.self_attn(positions, hidden_states, meta))
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden_states)), residual


def gemma_family(config: HFConfig, **overrides) -> DecoderFamily:
    bias = config.attention_bias
    properties = dict(qkv_bias=bias, o_bias=bias, norm=GemmaRMSNorm, activation=GeluTanhAndMul,
                      attention_scale=config.query_pre_attn_scalar ** -0.5, embed_scale=config.hidden_size ** 0.5,
                      final_logit_softcap=config.final_logit_softcapping)
    return DecoderFamily(**{**properties, **overrides})


class Gemma2ForCausalLM(DecoderForCausalLM):
    layer_class = GemmaDecoderLayer

    @staticmethod
    def family(config: HFConfig) -> DecoderFamily:
        return gemma_family(config, attn_logit_softcap=config.attn_logit_softcapping)


class Gemma3ForCausalLM(DecoderForCausalLM):
    layer_class = GemmaDecoderLayer

    @staticmethod
    def family(config: HFConfig) -> DecoderFamily:
        return gemma_family(config, qk_norm=True)


class Gemma3ForConditionalGeneration(ImageTextCheckpoint, Gemma3ForCausalLM):
    """Gemma 3's image-text checkpoint: the text model, and its SigLIP tower and projector (models/gemma3_vision.py),
    which turn each image into mm_tokens_per_image rows put in place of its image tokens' embeddings (after the
    embedding's scale, as transformers' masked_scatter does). Prefill lets an image's rows attend to each other both
    ways (AttentionMetadata.key_ends). Its text weights are under model.language_model. (transformers 5) or
    language_model.model. (transformers 4), the tower's under model.vision_tower. or vision_tower., the projector's
    under model.multi_modal_projector. or multi_modal_projector.."""

    # checkpoint prefix -> ours, first match wins
    text_prefixes = {"model.language_model.": "model.", "language_model.model.": "model.",
                     "language_model.lm_head.": "lm_head.", "lm_head.": "lm_head.",
                     "score.": "score.",  # Gemma3ForSequenceClassification's head
                     "model.": "model."}  # the decoder's own names (a LoRA adapter's modules, lora/adapter.py)
    vision_prefixes = {"model.vision_tower.": "vision_tower.", "vision_tower.": "vision_tower.",
                       "model.multi_modal_projector.": "multi_modal_projector.",
                       "multi_modal_projector.": "multi_modal_projector."}

    def __init__(self, config: HFConfig, backend):
        super().__init__(config, backend)
        self.visual = None
        if config.vision_config and self.model.stage.is_first:  # none in its config.json: its text model alone
            settings = Gemma3VisionSettings.from_config(config.vision_config, config.mm_tokens_per_image,
                                                        config.hidden_size)
            self.visual = Gemma3VisionTower(settings)

    @staticmethod
    def family(config: HFConfig) -> DecoderFamily:
        return gemma_family(config, qk_norm=True, final_logit_softcap=None)  # transformers caps none here

    def encode_images(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """[mm_tokens_per_image * images, hidden]: each processed image (the processor's [C, side, side], flat
        in pixel_values) through the tower and projector."""
        side = self.visual.settings.image_size
        return self.visual(pixel_values.reshape(len(grids), -1, side, side))
