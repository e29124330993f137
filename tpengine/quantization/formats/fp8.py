"""FP8 (e4m3) linears: the "fp8" method (transformers' FineGrainedFP8Config, vLLM's Fp8Config: DeepSeek-V3's and
Qwen's FP8 releases). A linear reads as an Fp8Weight with its scales and input_scale (readers.read_fp8, which
compressed-tensors' float-quantized linears share); the CPU converts it to float32 at load (read_linear)."""
from tpengine.quantization.config import Layout, LinearScheme, QuantizationConfig, register_format, register_layout
from tpengine.quantization.readers import fp8_scale_suffix, read_fp8

# the "fp8" method's: a block-scaled weight's scale is weight_scale_inv (it multiplies, despite its name)
_FP8_SUFFIXES = frozenset({"weight", "weight_scale", "weight_scale_inv", "input_scale"})
_FP8_FORMATS = ("e4m3",)
# transformers' FineGrainedFP8Config and vLLM's Fp8Config keys; "dequantize" is transformers' choice at load, not ours
_FP8_KNOWN_KEYS = {"quant_method", "fmt", "activation_scheme", "weight_block_size", "ignored_layers",
                   "modules_to_not_convert", "dequantize"}


@register_format("fp8")
def _fp8_config(d: dict) -> QuantizationConfig:
    """The "fp8" method (transformers' FineGrainedFP8Config, vLLM's Fp8Config): with weight_block_size, e4m3
    weights with a weight_scale_inv per block and activations quantized dynamically per 1 x block columns;
    without, one weight_scale per tensor and a dynamic or static (input_scale) per-tensor activation scale."""
    unknown = sorted(set(d) - _FP8_KNOWN_KEYS)
    if unknown:
        raise ValueError(f"fp8 quantization_config keys {unknown} are not supported; tpengine reads "
                         f"{sorted(_FP8_KNOWN_KEYS)}")
    if d.get("fmt", "e4m3") not in _FP8_FORMATS:
        raise ValueError(f"fp8 fmt {d.get('fmt')!r} is not supported; tpengine reads {_FP8_FORMATS}")
    activation_scheme = d.get("activation_scheme", "dynamic")
    if activation_scheme not in ("dynamic", "static"):
        raise ValueError(f"fp8 activation_scheme {activation_scheme!r} is not supported; use 'dynamic' or 'static'")
    block = d.get("weight_block_size")
    if block is not None:
        if not isinstance(block, (list, tuple)) or len(block) != 2 or \
                not all(isinstance(b, int) and b > 0 for b in block):
            raise ValueError(f"fp8 weight_block_size {block!r} must be [rows, columns] of positive integers")
        if activation_scheme != "dynamic":
            raise ValueError("fp8 with weight_block_size quantizes activations dynamically per group: "
                             f"activation_scheme {activation_scheme!r} is not supported with blocks")
    scheme = LinearScheme(layout="fp8", bits=8, group_size=None, symmetric=True, activation="float",
                          weight_type="float", strategy="tensor" if block is None else "block",
                          block_structure=None if block is None else tuple(block))
    not_converted = tuple(d.get("ignored_layers") or ()) + tuple(d.get("modules_to_not_convert") or ())
    return QuantizationConfig(method="fp8", schemes=((("Linear",), scheme),), not_converted=not_converted)


register_layout("fp8", Layout(_FP8_SUFFIXES, fp8_scale_suffix, read_fp8))
