"""A GGUF file's metadata as the config.json object hf_config.parse_hf_config reads, for the families whose GGUF
architecture we run. The keys are llama.cpp's (`{arch}.block_count`, ...), as its convert_hf_to_gguf.py writes them;
what the metadata does not say, the tensors do (the head tied to the embedding where there is no output.weight)."""
import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class GGUFArchitecture:
    """How one general.architecture reads: the family it is, and whether llama.cpp permuted its q/k rows."""
    model_type: str
    architecture: str  # config.json's architectures[0]
    permuted_qk: bool = False  # the converter interleaved each head's rotary halves (llama.cpp's LLaMA rope)
    bias_flags: bool = False  # its config class reads attention_bias and mlp_bias (Qwen2's always has q/k/v biases)
    keys: tuple[tuple[str, str], ...] = ()  # (config.json key, metadata key after "{arch}.") it requires besides
    settings: tuple[tuple[str, object], ...] = ()  # config.json keys llama.cpp's graph fixes for it
    layer_names: tuple[tuple[str, str], ...] = ()  # (GGUF tensor stem, Hugging Face name) where tensors.py's differ
    norm_plus_one: bool = False  # the converter added 1 to every norm weight (Gemma's RMSNorm scales by 1 + w)
    wide_query_scale_layers: int | None = None  # the block count of the one size whose query scale is 1/sqrt(hidden
    # / heads), not 1/sqrt(head_dim), in llama.cpp's graph (Gemma's 27B); query_pre_attn_scalar is not in the file
    # (config.json key, metadata key after "{arch}.") read where present and not 0 (llama.cpp's "none")
    optional_keys: tuple[tuple[str, str], ...] = ()


# Gemma's four norms a layer; llama.cpp names the pre-feedforward one ffn_norm, as other families' only second norm
_GEMMA_NORMS = (("ffn_norm", "pre_feedforward_layernorm"), ("post_attention_norm", "post_attention_layernorm"),
                ("post_ffw_norm", "post_feedforward_layernorm"))


ARCHITECTURES = {
    "llama": GGUFArchitecture("llama", "LlamaForCausalLM", permuted_qk=True, bias_flags=True),
    "qwen2": GGUFArchitecture("qwen2", "Qwen2ForCausalLM"),
    "qwen3": GGUFArchitecture("qwen3", "Qwen3ForCausalLM"),
    # llama.cpp's qwen3moe graph always renormalises the chosen experts' weights
    "qwen3moe": GGUFArchitecture("qwen3_moe", "Qwen3MoeForCausalLM", keys=(
        ("num_experts", "expert_count"), ("num_experts_per_tok", "expert_used_count"),
        ("moe_intermediate_size", "expert_feed_forward_length")), settings=(("norm_topk_prob", True),)),
    "gemma2": GGUFArchitecture("gemma2", "Gemma2ForCausalLM", keys=(
        ("attn_logit_softcapping", "attn_logit_softcapping"), ("final_logit_softcapping", "final_logit_softcapping"),
        ("sliding_window", "attention.sliding_window")), layer_names=_GEMMA_NORMS, norm_plus_one=True,
        wide_query_scale_layers=46),
    # llama.cpp's gemma3 graph: every sixth layer global (the family's default pattern), the sliding layers' rope
    # theta 10000 (the family's default rope_local_base_freq), the global ones' the file's rope.freq_base
    "gemma3": GGUFArchitecture("gemma3_text", "Gemma3ForCausalLM", keys=(
        ("sliding_window", "attention.sliding_window"),), layer_names=_GEMMA_NORMS, norm_plus_one=True,
        wide_query_scale_layers=62),
    # Phi-3's fused q/k/v and gate/up stay fused (attn_qkv, and ffn_up holding gate then up); its 128k models'
    # LongRoPE factors are tensors (rope_factors_long, rope_factors_short), read as the config's rope_scaling
    "phi3": GGUFArchitecture("phi3", "Phi3ForCausalLM", layer_names=(
        ("attn_qkv", "self_attn.qkv_proj"), ("ffn_up", "mlp.gate_up_proj")),
        optional_keys=(("sliding_window", "attention.sliding_window"),)),
    # gpt-oss: the experts' gate and up in their own tensors (the checkpoint's interleaved gate_up split), each
    # expert's projections and biases stacked; the sinks, the second norm and the router under their own names
    "gpt-oss": GGUFArchitecture("gpt_oss", "GptOssForCausalLM", bias_flags=True, keys=(
        ("num_experts", "expert_count"), ("num_experts_per_tok", "expert_used_count"),
        ("sliding_window", "attention.sliding_window")), layer_names=(
        ("attn_sinks", "self_attn.sinks"), ("post_attention_norm", "post_attention_layernorm"),
        ("ffn_gate_inp", "mlp.router"))),
}
# rope factors a file holds as tensors: the config reads them, no layer loads them
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")

# the tensor types that run from their own form (gguf/tensors.py reads each); any other is a ValueError
RUNNABLE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                  "IQ4_NL", "IQ4_XS", "MXFP4")

# config.json key -> the metadata key that gives it, after "{arch}."; every one required
_REQUIRED = {"hidden_size": "embedding_length", "intermediate_size": "feed_forward_length",
             "num_hidden_layers": "block_count", "num_attention_heads": "attention.head_count",
             "max_position_embeddings": "context_length", "rms_norm_eps": "attention.layer_norm_rms_epsilon"}
_OPTIONAL = {"num_key_value_heads": "attention.head_count_kv", "rope_theta": "rope.freq_base",
             "head_dim": "attention.key_length"}
# end-of-generation tokens llama.cpp stops at besides EOS (end of turn, end of message)
_END_TOKENS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def gguf_architecture(metadata: dict, source: str) -> tuple[str, GGUFArchitecture]:
    """(general.architecture, how it reads); ValueError naming it when we run no such family."""
    name = metadata.get("general.architecture")
    if name not in ARCHITECTURES:
        raise ValueError(f"{source}: GGUF architecture {name!r} (general.architecture) is not supported; "
                         f"supported: {', '.join(ARCHITECTURES)}")
    return name, ARCHITECTURES[name]


def check_type(tensor) -> str:
    """A gguf.ReaderTensor's type name; ValueError naming it and the tensor where no kernel of ours runs it."""
    name = tensor.tensor_type.name
    if name not in RUNNABLE_TYPES:
        raise ValueError(f"GGUF tensor {tensor.name!r} is of type {name}, which tpengine does not run yet "
                         f"(it runs {', '.join(RUNNABLE_TYPES)}); it is not converted to float")
    return name


def _required(metadata: dict, key: str, source: str):
    if key not in metadata:
        raise ValueError(f"{source}: the GGUF metadata lacks the key {key!r}")
    return metadata[key]


def _rope_scaling(metadata: dict, arch: str, source: str) -> dict | None:
    """rope_scaling from `{arch}.rope.scaling.*`: linear and YaRN, as the converter writes them."""
    kind = metadata.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    factor = _required(metadata, f"{arch}.rope.scaling.factor", source)
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        original = _required(metadata, f"{arch}.rope.scaling.original_context_length", source)
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    raise ValueError(f"{source}: {arch}.rope.scaling.type {kind!r} is not supported; tpengine reads linear and yarn")


# low_freq_factor, high_freq_factor, original_max_position_embeddings: llama.cpp's converter's defaults, and
# Llama 3.1-3.3's values
_LLAMA3_DEFAULTS = (1.0, 4.0, 8192)


def _llama3_rope_freqs(theta: float, head_dim: int, factor: float, low: float, high: float,
                       original: int) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's converter computes it from a llama3 rope_scaling (LlamaModel.
    generate_extra_tensors): per frequency, the divisor of its inverse frequency. In float64 where the converter
    runs float32: the two agree to a few float32 roundings, well inside the check's 1e-5."""
    inv_freq = 1.0 / np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim))
    wavelen = 2 * math.pi / inv_freq.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        smooth = (original / wavelen - low) / (high - low)
        medium = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, medium)) \
        .astype(np.float32)


def _fitted_llama3(factors: np.ndarray, inv_freq_wavelen: np.ndarray, factor: float) -> tuple | None:
    """(low, high, original) from the blended frequencies, low_freq_factor taken as 1: their smooth factor is
    original / wavelen / (high - 1) - 1 / (high - 1), a line in 1 / wavelen (scaling all three gives the same rope)."""
    medium = (factors > 1) & (factors < factor)
    if medium.sum() < 2:
        return None
    smooth = (1 / factors[medium].astype(np.float64) - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(1 / inv_freq_wavelen[medium], smooth, 1)
    if intercept >= 0:
        return None
    high = 1 - 1 / intercept
    return 1.0, float(round(high, 4)), int(round(-slope / intercept))


def _llama3_rope_scaling(checkpoint, arch: str, head_dim: int) -> dict | None:
    """The llama3 rope_scaling whose factors, computed as llama.cpp's converter does, are the file's
    rope_freqs.weight (its metadata keeps no rope_scaling for llama3); None where every factor is 1. ValueError
    where none reproduces them: the tensor is not a llama3 rope's."""
    source, tensor = checkpoint.path, checkpoint.tensors["rope_freqs.weight"]
    factors = np.asarray(tensor.data, dtype=np.float32).reshape(-1)
    if factors.shape[0] != head_dim // 2:
        raise ValueError(f"{source}: the GGUF tensor 'rope_freqs.weight' has {factors.shape[0]} factors, but the "
                         f"metadata's head size {head_dim} makes it {head_dim // 2}")
    if np.all(factors == 1):
        return None
    theta = checkpoint.metadata.get(f"{arch}.rope.freq_base", 10000.0)
    factor = float(factors.max())
    wavelen = 2 * math.pi * np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim))
    for candidate in (_LLAMA3_DEFAULTS, _fitted_llama3(factors, wavelen.astype(np.float64), factor)):
        if candidate is not None and candidate[0] != candidate[1] and np.allclose(
                _llama3_rope_freqs(theta, head_dim, factor, *candidate), factors, rtol=1e-5, atol=0):
            low, high, original = candidate
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": original}
    raise ValueError(f"{source}: the GGUF tensor 'rope_freqs.weight' holds per-frequency rope factors that no llama3 "
                     "rope scaling reproduces (neither Llama 3.1's low_freq_factor 1, high_freq_factor 4, "
                     "original_max_position_embeddings 8192 nor a fit of its blended frequencies); tpengine runs "
                     "llama3 rope scaling only")


def _query_pre_attn_scalar(config: dict, described: GGUFArchitecture) -> int:
    """The query scale llama.cpp's graph takes (its file keeps none): 1/sqrt(head_dim), or 1/sqrt(hidden / heads)
    for the one size whose checkpoint says so."""
    if config["num_hidden_layers"] == described.wide_query_scale_layers:
        return config["hidden_size"] // config["num_attention_heads"]
    return _head_dim(config)


def _head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def _end_tokens(metadata: dict) -> int | list[int] | None:
    ids = list(dict.fromkeys(metadata[key] for key in _END_TOKENS if key in metadata))
    return ids[0] if len(ids) == 1 else ids or None


def hf_config_dict(checkpoint) -> dict:
    """The config.json object a Hugging Face checkpoint of this GGUF file (files.GGUFCheckpoint) would have.
    ValueError naming the key or tensor the engine cannot read (an unknown architecture, a missing key, a rope_freqs
    tensor that is no llama3 rope scaling's)."""
    metadata, tensor_names, source = checkpoint.metadata, set(checkpoint.tensors), checkpoint.path
    arch, described = gguf_architecture(metadata, source)
    if "token_embd.weight" not in tensor_names:
        raise ValueError(f"{source}: the GGUF file lacks the tensor 'token_embd.weight'")
    for tensor in checkpoint.tensors.values():
        check_type(tensor)
    config = {"architectures": [described.architecture], "model_type": described.model_type,
              "vocab_size": int(checkpoint.tensors["token_embd.weight"].shape[-1]),  # ggml lists dims innermost first
              "tie_word_embeddings": "output.weight" not in tensor_names,
              "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"), "eos_token_id": _end_tokens(metadata)}
    config.update(described.settings)
    config.update((key, _required(metadata, f"{arch}.{gguf_key}", source))
                  for key, gguf_key in (*_REQUIRED.items(), *described.keys))
    config.update((key, metadata[f"{arch}.{gguf_key}"]) for key, gguf_key in _OPTIONAL.items()
                  if f"{arch}.{gguf_key}" in metadata)
    if "head_dim" not in config and described.permuted_qk and f"{arch}.rope.dimension_count" in metadata:
        config["head_dim"] = metadata[f"{arch}.rope.dimension_count"]  # LLaMA rotates whole heads
    if described.wide_query_scale_layers is not None:
        config["query_pre_attn_scalar"] = _query_pre_attn_scalar(config, described)
    if described.bias_flags:
        config.update(attention_bias="blk.0.attn_q.bias" in tensor_names, mlp_bias="blk.0.ffn_up.bias" in tensor_names)
    config.update((key, metadata[f"{arch}.{gguf_key}"]) for key, gguf_key in described.optional_keys
                  if metadata.get(f"{arch}.{gguf_key}"))
    rotary_dims = metadata.get(f"{arch}.rope.dimension_count")
    if described.model_type == "phi3" and rotary_dims and rotary_dims < _head_dim(config):  # Phi-4-mini's
        config["partial_rotary_factor"] = rotary_dims / _head_dim(config)
    config.update(_rope_config(checkpoint, arch, _head_dim(config)))
    return config


def _rope_config(checkpoint, arch: str, head_dim: int) -> dict:
    """The config.json keys of the file's rope scaling: rope_scaling from the metadata, llama 3's from its
    rope_freqs tensor, LongRoPE's from its factor tensors (with their pre-training window)."""
    tensor_names, source = set(checkpoint.tensors), checkpoint.path
    rope_scaling = _rope_scaling(checkpoint.metadata, arch, source)
    if "rope_freqs.weight" in tensor_names:  # llama 3's rope scaling, stored as per-frequency factors
        rope_scaling = _llama3_rope_scaling(checkpoint, arch, head_dim)
    if "rope_factors_long.weight" in tensor_names:
        factors = {kind: np.asarray(checkpoint.tensors[f"rope_factors_{kind}.weight"].data, dtype=np.float32)
                   .reshape(-1).tolist() for kind in ("long", "short") if f"rope_factors_{kind}.weight" in tensor_names}
        if set(factors) != {"long", "short"}:
            raise ValueError(f"{source}: the GGUF file holds rope_factors_long.weight but not rope_factors_short.weight")
        original = _required(checkpoint.metadata, f"{arch}.rope.scaling.original_context_length", source)
        return {"rope_scaling": {"rope_type": "longrope", "long_factor": factors["long"],
                                 "short_factor": factors["short"]}, "original_max_position_embeddings": original}
    # no scaling in the file is none in llama.cpp's graph, whatever the family's config class defaults to (gpt-oss's
    # is YaRN)
    return {"rope_scaling": rope_scaling or {"rope_type": "default"}}



def check_shapes(checkpoint, config) -> None:
    """ValueError naming the first tensor whose shape is not the one the config (an HFConfig read from the metadata)
    gives it: told on rank 0, before any worker starts. Shapes as Hugging Face's [out, in] (ggml lists them innermost
    first); an expert tensor stacks the experts first."""
    hidden, inter, vocab, experts = (config.hidden_size, config.intermediate_size, config.vocab_size,
                                     config.num_experts)
    head_dim = config.head_dim or hidden // config.num_attention_heads
    # gpt-oss's experts are intermediate_size wide (it has no moe_intermediate_size)
    q, kv, expert_inter = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim, \
        config.moe_intermediate_size or config.intermediate_size
    _, described = gguf_architecture(checkpoint.metadata, checkpoint.path)
    gate_up = dict(described.layer_names).get("ffn_up") == "mlp.gate_up_proj"  # Phi-3's: gate then up in one
    expected = {"token_embd": (vocab, hidden), "output": (vocab, hidden), "output_norm": (hidden,),
                "attn_norm": (hidden,), "ffn_norm": (hidden,), "post_attention_norm": (hidden,),
                "post_ffw_norm": (hidden,), "attn_q_norm": (head_dim,), "attn_k_norm": (head_dim,),
                "attn_q": (q, hidden), "attn_k": (kv, hidden), "attn_v": (kv, hidden), "attn_output": (hidden, q),
                "attn_qkv": (q + 2 * kv, hidden), "ffn_gate": (inter, hidden),
                "ffn_up": (2 * inter if gate_up else inter, hidden), "ffn_down": (hidden, inter),
                "ffn_gate_inp": (experts, hidden), "ffn_gate_exps": (experts, expert_inter, hidden),
                "ffn_up_exps": (experts, expert_inter, hidden), "ffn_down_exps": (experts, hidden, expert_inter)}
    for name, tensor in checkpoint.tensors.items():
        *_, stem, suffix = name.split(".")
        want = expected.get(stem)
        if want is None:
            continue
        want = want[:-1] if suffix == "bias" else want  # a bias per output (per expert and output when stacked)
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if shape != want:
            raise ValueError(f"{checkpoint.path}: GGUF tensor {name!r} has shape {list(shape)}, but the metadata makes "
                             f"it {list(want)}")
