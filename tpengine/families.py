"""The supported model families, one description each: what transformers' config class makes of config.json's
keys, and which model class serves the family.

Adding a family is one Family here and its model file in tpengine/models/. Nothing here imports torch or
transformers: rank 0 reads these (tpengine/hf_config.py) before any worker starts.
"""
from collections.abc import Mapping
from dataclasses import dataclass, field

SILU_ACTIVATIONS = ("silu", "swish")  # transformers' ACT2FN maps both to SiLU
DEFAULT_ROPE_THETA = 10000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta


@dataclass(frozen=True)
class Family:
    """One model_type as config.json names it."""
    model_type: str
    architecture: str  # config.json's architectures[0]; the model class of that name lives in model_module
    model_module: str  # imported only when a model is built
    # the default its transformers config class (transformers/models/<type>/configuration_<type>.py) gives each key
    # hf_config.py reads. A key the class does not declare is absent from a loaded config unless config.json has it:
    # it then takes HFConfig's default, the value our code gives an absent one.
    defaults: Mapping[str, object]
    key_aliases: Mapping[str, str] = field(default_factory=dict)  # attribute_map: field -> the key that wins
    activation_key: str | None = "hidden_act"  # the key naming the MLP's activation; None: the model ignores it
    activations: tuple[str, ...] = SILU_ACTIVATIONS  # those its gated MLP runs: the first, and its aliases
    # layer_types absent from config.json: every n-th layer attends fully, the others slide; n is the number given
    # or the setting named; None: layer_types stay absent (or the family's config class derives them otherwise)
    sliding_pattern: int | str | None = None
    rope_theta: float = DEFAULT_ROPE_THETA  # its config class's default_theta
    rope_parameters: Mapping[str, object] | None = None  # what its config class sets when config.json has none
    # rope parameters per layer type (Gemma 3): layer type -> (the transformers 4 key giving its theta, the default)
    layer_type_thetas: Mapping[str, tuple[str, float]] | None = None
    # its attention rotates only the first partial_rotary_factor of each head, and its config class always holds the
    # factor in rope_parameters
    partial_rotary: bool = False
    # its generate switches LongRoPE's factors as models/phi3.py says; its config class reads rope types su and yarn
    # as longrope, whose window is its top-level original_max_position_embeddings
    longrope: bool = False
    requires_whole_heads: bool = False  # its config class refuses a hidden_size num_attention_heads does not divide
    # a multimodal config whose text_config, a config of this model_type, holds the text model's settings
    text_model_type: str | None = None
    # multi-head latent attention (DeepSeek): its config class sets head_dim to qk_rope_head_dim, whatever
    # config.json says, and the attention caches one latent per token, no per-head keys
    latent_attention: bool = False
    # its model reads images: its vision tower runs on the ranks (tpengine/multimodal/)
    images: bool = False
    # a checkpoint may name its architecture; False: the text part of a multimodal family alone (its rules only)
    standalone: bool = True
    # M-RoPE (layers/mrope.py): the split of each head's frequencies its config class takes when rope_parameters
    # gives none (None: one position per token), and whether the sections interleave (Qwen3-VL)
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False
    # an image's tokens attend to each other both ways in prefill (Gemma 3): a step computes an image's tokens
    # together, and the attention's key limit reaches to the image's end for them (AttentionMetadata.key_ends)
    bidirectional_images: bool = False


QWEN3 = Family(
    "qwen3", "Qwen3ForCausalLM", "tpengine.models.qwen3",
    defaults=dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, head_dim=128, hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
        tie_word_embeddings=False, attention_bias=False, use_sliding_window=False, sliding_window=4096,
        max_window_layers=28, layer_types=None, bos_token_id=None, eos_token_id=None))
QWEN2 = Family(
    "qwen2", "Qwen2ForCausalLM", "tpengine.models.qwen2",
    defaults=dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
        tie_word_embeddings=False, use_sliding_window=False, sliding_window=4096, max_window_layers=28,
        layer_types=None, bos_token_id=None, eos_token_id=None))
LLAMA = Family(
    "llama", "LlamaForCausalLM", "tpengine.models.llama", requires_whole_heads=True,
    defaults=dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=None, hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-6,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
        head_dim=None))
MISTRAL = Family(
    "mistral", "MistralForCausalLM", "tpengine.models.mistral",
    defaults=dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=None, hidden_act="silu", max_position_embeddings=4096 * 32, rms_norm_eps=1e-6,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, sliding_window=4096))
QWEN3_MOE = Family(
    "qwen3_moe", "Qwen3MoeForCausalLM", "tpengine.models.qwen3_moe", key_aliases={"num_experts": "num_local_experts"},
    defaults=dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=32,
        num_key_value_heads=4, hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
        tie_word_embeddings=False, attention_bias=False, use_sliding_window=False, sliding_window=4096,
        decoder_sparse_step=1, moe_intermediate_size=768, num_experts_per_tok=8, num_experts=128,
        norm_topk_prob=False, mlp_only_layers=None, bos_token_id=None, eos_token_id=None))
# Gemma's MLPs read hidden_activation, not hidden_act: GELU with the tanh approximation, torch's own
GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh",)
GEMMA2 = Family(
    "gemma2", "Gemma2ForCausalLM", "tpengine.models.gemma",
    activation_key="hidden_activation", activations=GEMMA_ACTIVATIONS, sliding_pattern=2,  # sliding first
    defaults=dict(
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192,
        rms_norm_eps=1e-6, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True, attention_bias=False,
        query_pre_attn_scalar=256, sliding_window=4096, layer_types=None, final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0, use_bidirectional_attention=None))
GEMMA3_TEXT = Family(
    "gemma3_text", "Gemma3ForCausalLM", "tpengine.models.gemma",
    activation_key="hidden_activation", activations=GEMMA_ACTIVATIONS, sliding_pattern="sliding_window_pattern",
    # Gemma3TextConfig.default_theta, and the transformers 4 key that gave each
    layer_type_thetas={"full_attention": ("rope_theta", 1_000_000.0),
                       "sliding_attention": ("rope_local_base_freq", 10_000.0)},
    defaults=dict(
        vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131_072,
        rms_norm_eps=1e-6, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True, attention_bias=False,
        query_pre_attn_scalar=256, sliding_window=4096, layer_types=None, final_logit_softcapping=None,
        attn_logit_softcapping=None, use_bidirectional_attention=False, sliding_window_pattern=6))
# Gemma3ForConditionalGeneration: the text model's settings are its text_config's; these few are the outer config's own.
# Its SigLIP tower and projector (models/gemma3_vision.py) make mm_tokens_per_image rows per image, bidirectional
GEMMA3 = Family("gemma3", "Gemma3ForConditionalGeneration", "tpengine.models.gemma", text_model_type="gemma3_text",
                images=True, bidirectional_images=True,
                key_aliases={"image_token_id": "image_token_index", "boi_token_id": "boi_token_index",
                             "eoi_token_id": "eoi_token_index"},
                defaults=dict(tie_word_embeddings=True, vision_config={}, mm_tokens_per_image=256,
                              boi_token_index=255_999, eoi_token_index=256_000, image_token_index=262_144))
# Qwen2.5-VL: the text model is Qwen2's decoder (bias on q, k and v) rotated with M-RoPE; the vision tower and the
# image tokens' ids are the outer config's (models/qwen2_5_vl.py)
QWEN2_5_VL_TEXT = Family(
    "qwen2_5_vl_text", "Qwen2_5_VLTextModel", "tpengine.models.qwen2_5_vl", rope_theta=1_000_000.0, standalone=False,
    defaults=dict(
        vocab_size=152064, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-5,
        tie_word_embeddings=False, use_sliding_window=False, sliding_window=4096, max_window_layers=80,
        layer_types=None, bos_token_id=151643, eos_token_id=151645))
# the image tokens' ids of Qwen's image-text checkpoints, as their config classes default them
QWEN_VISION_TOKENS = dict(vision_config={}, image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                          vision_end_token_id=151653)
QWEN2_5_VL = Family("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", "tpengine.models.qwen2_5_vl",
                    text_model_type="qwen2_5_vl_text", images=True, mrope_section=(16, 24, 24),
                    defaults=dict(tie_word_embeddings=False, **QWEN_VISION_TOKENS))
# Qwen3-VL: Qwen3's decoder (q/k norms) with interleaved M-RoPE, and deepstack: the vision tower's earlier layers'
# features added to the first decoder layers' image rows (models/qwen3_vl.py)
QWEN3_VL_TEXT = Family(
    "qwen3_vl_text", "Qwen3VLTextModel", "tpengine.models.qwen3_vl", rope_theta=500_000.0, standalone=False,
    defaults=dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, head_dim=128, hidden_act="silu", max_position_embeddings=128000, rms_norm_eps=1e-6,
        tie_word_embeddings=False, attention_bias=False, bos_token_id=None, eos_token_id=None))
QWEN3_VL = Family("qwen3_vl", "Qwen3VLForConditionalGeneration", "tpengine.models.qwen3_vl",
                  text_model_type="qwen3_vl_text", images=True, mrope_section=(24, 20, 20), mrope_interleaved=True,
                  defaults=dict(tie_word_embeddings=False, **QWEN_VISION_TOKENS))
# Qwen3-VL MoE (Qwen3-VL-30B-A3B): Qwen3-VL's decoder whose MLPs are Qwen3-MoE's experts, the router always
# renormalising its top-k weights (models/qwen3_vl_moe.py)
QWEN3_VL_MOE_TEXT = Family(
    "qwen3_vl_moe_text", "Qwen3VLMoeTextModel", "tpengine.models.qwen3_vl_moe", rope_theta=500_000.0,
    standalone=False, key_aliases={"num_experts": "num_local_experts"},
    defaults=dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16,
        num_key_value_heads=16, head_dim=None, hidden_act="silu", max_position_embeddings=128000, rms_norm_eps=1e-6,
        tie_word_embeddings=True, attention_bias=False, decoder_sparse_step=1, moe_intermediate_size=1408,
        num_experts_per_tok=4, num_experts=60, mlp_only_layers=None, bos_token_id=None, eos_token_id=None))
QWEN3_VL_MOE = Family("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration", "tpengine.models.qwen3_vl_moe",
                      text_model_type="qwen3_vl_moe_text", images=True, mrope_section=(24, 20, 20),
                      mrope_interleaved=True, defaults=dict(tie_word_embeddings=False, **QWEN_VISION_TOKENS))
PHI3 = Family(
    "phi3", "Phi3ForCausalLM", "tpengine.models.phi3", partial_rotary=True, longrope=True,
    defaults=dict(
        vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=None, hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=32000, sliding_window=None,
        original_max_position_embeddings=4096, partial_rotary_factor=1.0))
GPT_OSS = Family(
    "gpt_oss", "GptOssForCausalLM", "tpengine.models.gpt_oss", key_aliases={"num_experts": "num_local_experts"},
    activation_key=None,  # its experts run their clamped SwiGLU whatever hidden_act says: transformers never reads it
    sliding_pattern=2,  # sliding first
    rope_theta=150000.0, rope_parameters=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                              truncate=False, original_max_position_embeddings=4096),
    defaults=dict(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=36, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-5,
        tie_word_embeddings=False, attention_bias=True, sliding_window=128, layer_types=None, num_experts=128,
        num_experts_per_tok=4, swiglu_alpha=1.702, swiglu_limit=7.0, bos_token_id=None, eos_token_id=None))

# DeepSeek's MLA keys, as DeepseekV2Config and DeepseekV3Config default them; the V2 class routes by softmax (greedy or
# group-limited), the V3 class by sigmoid with a correction bias and top-2 group sums (models/deepseek.py)
DEEPSEEK_MLA = dict(kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                    head_dim=None, hidden_act="silu", rms_norm_eps=1e-6, attention_bias=False, mlp_bias=False,
                    tie_word_embeddings=False)
DEEPSEEK_V2 = Family(
    "deepseek_v2", "DeepseekV2ForCausalLM", "tpengine.models.deepseek", latent_attention=True,
    key_aliases={"num_experts": "n_routed_experts"},
    defaults=dict(
        DEEPSEEK_MLA, vocab_size=102400, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=None, max_position_embeddings=2048, bos_token_id=1,
        eos_token_id=2, first_k_dense_replace=0, n_group=None, num_experts=64, n_shared_experts=2,
        routed_scaling_factor=1.0, topk_group=None, topk_method="greedy", norm_topk_prob=False,
        num_experts_per_tok=None, moe_intermediate_size=1407))
DEEPSEEK_V3 = Family(
    "deepseek_v3", "DeepseekV3ForCausalLM", "tpengine.models.deepseek", latent_attention=True,
    key_aliases={"num_experts": "n_routed_experts", "num_nextn_predict_layers": "num_mtp_layers"},
    defaults=dict(
        DEEPSEEK_MLA, vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
        num_experts=256, routed_scaling_factor=2.5, n_group=8, topk_group=4, num_experts_per_tok=8,
        first_k_dense_replace=3, norm_topk_prob=True, max_position_embeddings=4096, bos_token_id=0,
        eos_token_id=1, rope_interleave=True, num_nextn_predict_layers=1))

# model_type -> its description, in the order errors list them
FAMILIES = {family.model_type: family for family in (QWEN3, QWEN2, LLAMA, MISTRAL, QWEN3_MOE, GEMMA2, GEMMA3_TEXT,
                                                     GEMMA3, QWEN2_5_VL_TEXT, QWEN2_5_VL, QWEN3_VL_TEXT, QWEN3_VL,
                                                     PHI3, GPT_OSS,
                                                     DEEPSEEK_V2, DEEPSEEK_V3, QWEN3_VL_MOE_TEXT,
                                                     QWEN3_VL_MOE)}
# model_types whose configs a family's config class reads: Kimi K2's config.json says kimi_k2 (its remote code is
# DeepSeek V3's config class) and architectures DeepseekV3ForCausalLM
MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}
# the architectures[0] values served
ARCHITECTURES = tuple(family.architecture for family in FAMILIES.values() if family.standalone)
assert len(set(ARCHITECTURES)) == len(ARCHITECTURES), "one family per architecture"
# a family's causal LM with a classification head on its last token in place of the LM head (a cross-encoder
# reranker such as Qwen3ForSequenceClassification): the same decoder, loaded for scoring
CLASSIFIER_SUFFIX = "ForSequenceClassification"


# classifiers whose causal LM is not named by the rule: Gemma 3's text-only one, and its multimodal one (the text
# model under text_config, as Gemma3ForConditionalGeneration reads it)
CLASSIFIER_BASES = {"Gemma3TextForSequenceClassification": "Gemma3ForCausalLM",
                    "Gemma3ForSequenceClassification": "Gemma3ForConditionalGeneration"}


def causal_architecture(architecture: str) -> str:
    """The causal LM a classifier architecture is built on (Qwen3ForSequenceClassification -> Qwen3ForCausalLM);
    any other architecture is its own."""
    if architecture in CLASSIFIER_BASES:
        return CLASSIFIER_BASES[architecture]
    if architecture.endswith(CLASSIFIER_SUFFIX):
        return architecture.removesuffix(CLASSIFIER_SUFFIX) + "ForCausalLM"
    return architecture
