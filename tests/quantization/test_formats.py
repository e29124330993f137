"""Checkpoint formats read into QuantizedWeight, measured against the producing library's own decompression
(compressed-tensors) or a plain unpacking of the documented layout written here (GPTQ, AWQ), bit for bit."""
import json
from dataclasses import replace

import pytest
import torch
from compressed_tensors.compressors.naive_quantized.base import (FloatQuantizationCompressor,
                                                                 IntQuantizationCompressor)
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from safetensors.torch import load_file

from tests.quantization.checkpoints import (CheckpointFormat, QUANTIZED_LINEAR, pack_fp8, pack_tensors,
                                            quantization_config, quantize_linear, write_quantized_and_reference)
from tpengine.quantization.config import QuantizationConfig
from tpengine.quantization.online import quantize_weight
from tpengine.quantization.weights import QuantizedWeight, cat_rows

OUT, IN = 48, 128


def _weight(seed: int = 0, out_features: int = OUT, in_features: int = IN) -> torch.Tensor:
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    weight[3] = 0  # an all-zero row must not divide by zero
    weight[5, :] = weight[5, :].abs()  # a row with no negative values: an asymmetric zero point at the edge
    return weight


def _linear(fmt: CheckpointFormat, seed: int = 0, scale_dtype=torch.float32):
    """(the QuantizedWeight packed, its checkpoint tensors by suffix, the config reading them)."""
    generator = torch.Generator().manual_seed(seed)
    qw = quantize_linear(_weight(seed), fmt, generator, scale_dtype)
    if fmt.method == "float-quantized":
        tensors = pack_fp8(_weight(seed), fmt, scale_dtype)
    else:
        tensors = pack_tensors(qw, fmt, scale_dtype)
    return qw, tensors, QuantizationConfig.from_hf(quantization_config(fmt))


def _ct_args(fmt: CheckpointFormat) -> QuantizationArgs:
    return QuantizationArgs(num_bits=fmt.bits, symmetric=fmt.sym, strategy="group" if fmt.group_size else "channel",
                            group_size=fmt.group_size)


# --- compressed-tensors ----------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, None])
@pytest.mark.parametrize("sym", [True, False])
def test_pack_quantized_matches_compressed_tensors_decompress(bits, group_size, sym):
    fmt = CheckpointFormat("pack-quantized", bits=bits, group_size=group_size, sym=sym)
    _, tensors, config = _linear(fmt)
    read = config.read_linear("model.layers.0.mlp.up_proj", tensors)
    scheme = QuantizationScheme(targets=["Linear"], weights=_ct_args(fmt))
    expected = PackedQuantizationCompressor.decompress(dict(tensors), scheme)["weight"]
    assert read.bits == bits and (read.zeros is None) == sym and read.group_index is None
    assert torch.equal(read.dequantize(), expected.float())


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_quantized_reads_shapes_that_do_not_fill_whole_words(bits):
    fmt = CheckpointFormat("pack-quantized", bits=bits, group_size=None, sym=False)
    qw = quantize_linear(_weight(out_features=45, in_features=100), fmt, torch.Generator(), torch.float32)
    tensors = pack_tensors(qw, fmt, torch.float32)
    read = QuantizationConfig.from_hf(quantization_config(fmt)).read_linear("model.layers.0.mlp.up_proj", tensors)
    scheme = QuantizationScheme(targets=["Linear"], weights=_ct_args(fmt))
    expected = PackedQuantizationCompressor.decompress(dict(tensors), scheme)["weight"]
    assert read.shape == (45, 100) and torch.equal(read.dequantize(), expected.float())


@pytest.mark.parametrize("sym", [True, False])
def test_pack_quantized_equals_what_compressed_tensors_compress_writes(sym):
    fmt = CheckpointFormat("pack-quantized", group_size=32, sym=sym)
    qw, tensors, _ = _linear(fmt)
    state = {"weight": qw.dequantize(), "weight_scale": qw.scales}
    if not sym:
        state["weight_zero_point"] = qw.zeros.to(torch.int8)
    compressed = PackedQuantizationCompressor.compress(state, QuantizationScheme(targets=["Linear"],
                                                                                 weights=_ct_args(fmt)))
    assert set(compressed) == set(tensors)
    for suffix, tensor in compressed.items():
        assert torch.equal(tensor, tensors[suffix]), suffix


@pytest.mark.parametrize("sym", [True, False])
def test_pack_quantized_act_order_reads_weight_g_idx(sym):
    fmt = CheckpointFormat("pack-quantized", group_size=32, sym=sym, desc_act=True)
    qw, tensors, config = _linear(fmt)
    read = config.read_linear("model.layers.0.self_attn.q_proj", tensors)
    # compressed-tensors 0.20 no longer applies g_idx, so: its unpacking, then each column's group
    values = unpack_from_int32(tensors["weight_packed"], 4, torch.Size([OUT, IN])).float()
    groups = tensors["weight_g_idx"].long()
    if not sym:
        zero_point = unpack_from_int32(tensors["weight_zero_point"], 4, torch.Size([OUT, IN // 32]), packed_dim=0)
        values = values - zero_point.float()[:, groups]
    assert read.group_index is not None and torch.equal(read.group_index, qw.group_index)
    assert torch.equal(read.dequantize(), values * tensors["weight_scale"][:, groups])


def test_int_quantized_reads_int8_weights_with_int8_activations():
    fmt = CheckpointFormat("int-quantized", group_size=None)
    _, tensors, config = _linear(fmt)
    read = config.read_linear("model.layers.1.mlp.down_proj", tensors)
    scheme = QuantizationScheme(targets=["Linear"], weights=_ct_args(fmt), input_activations=QuantizationArgs(
        num_bits=8, strategy="token", dynamic=True))
    expected = IntQuantizationCompressor.decompress(dict(tensors), scheme)["weight"]
    assert read.activation == "int8" and config.activation == "int8"
    assert torch.equal(read.dequantize(), expected.float())


@pytest.mark.parametrize("strategy", ["tensor", "channel"])
def test_float_quantized_reads_fp8_as_float32(strategy):
    fmt = CheckpointFormat("float-quantized", fp8_strategy=strategy)
    _, tensors, config = _linear(fmt)
    read = config.read_linear("model.layers.0.self_attn.o_proj", tensors)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=8, type="float",
                                                                             strategy=strategy))
    expected = FloatQuantizationCompressor.decompress(dict(tensors), scheme)["weight"]
    assert read.dtype == torch.float32 and torch.equal(read, expected.float())


def test_float_quantized_reads_fp8_blocks():
    weight = _weight()
    scale = torch.rand(OUT // 16, IN // 32) + 0.5
    tensors = {"weight": (weight / scale.repeat_interleave(16, 0).repeat_interleave(32, 1)).to(torch.float8_e4m3fn),
               "weight_scale": scale}
    config = QuantizationConfig.from_hf(_with_weights(quantization_config(CheckpointFormat("float-quantized")),
                                                      strategy="block", block_structure=[16, 32]))
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=8, type="float", strategy="block", block_structure=[16, 32]))
    expected = FloatQuantizationCompressor.decompress(dict(tensors), scheme)["weight"]
    assert torch.equal(config.read_linear("model.layers.0.mlp.up_proj", tensors), expected.float())


def _with_weights(config: dict, **changes) -> dict:
    config["config_groups"]["group_0"]["weights"].update(changes)
    return config


def _with_inputs(config: dict, **changes) -> dict:
    config["config_groups"]["group_0"]["input_activations"].update(changes)
    return config


# --- GPTQ and AWQ: the documented layouts, unpacked one column at a time -----------------------------------

def _unpack_columns(packed: torch.Tensor, bits: int, count: int, order=None) -> torch.Tensor:
    """[rows, count] unsigned values: value j is in word j // (32 / bits), at bit position (j % per word) * bits,
    or, with order, at the position of j's place in order (AWQ)."""
    per_word = 32 // bits
    columns = []
    for j in range(count):
        position = j % per_word if order is None else order.index(j % per_word)
        columns.append((packed[:, j // per_word].long() >> (position * bits)) & ((1 << bits) - 1))
    return torch.stack(columns, dim=1)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size, desc_act", [(32, False), (None, False), (32, True)])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
def test_gptq_matches_the_documented_layout(bits, group_size, desc_act, sym, checkpoint_format):
    fmt = CheckpointFormat("gptq", bits=bits, group_size=group_size, desc_act=desc_act, sym=sym,
                           checkpoint_format=checkpoint_format)
    qw, tensors, config = _linear(fmt, scale_dtype=torch.float16)
    read = config.read_linear("model.layers.0.mlp.gate_proj", tensors)
    # qweight [in / per word, out] packs input features; qzeros [groups, out / per word] packs output features
    values = _unpack_columns(tensors["qweight"].t(), bits, IN)
    zeros = _unpack_columns(tensors["qzeros"], bits, OUT).t() + (1 if checkpoint_format == "gptq" else 0)
    groups = tensors["g_idx"].long()
    expected = (values - zeros[:, groups]).float() * tensors["scales"].float().t()[:, groups]
    assert torch.equal(read.dequantize(), expected)
    assert (read.group_index is not None) == desc_act and (read.zeros is None) == sym
    assert torch.equal(read.dequantize(), qw.dequantize())


@pytest.mark.parametrize("group_size", [32, None])
def test_awq_matches_the_documented_layout(group_size):
    fmt = CheckpointFormat("awq", group_size=group_size)
    qw, tensors, config = _linear(fmt, scale_dtype=torch.float16)
    read = config.read_linear("model.layers.0.mlp.down_proj", tensors)
    order = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ gemm: nibble i holds column order[i] of each 8
    values = _unpack_columns(tensors["qweight"], 4, OUT, order).t()
    zeros = _unpack_columns(tensors["qzeros"], 4, OUT, order).t()
    groups = torch.arange(IN) // (group_size or IN)
    expected = (values - zeros[:, groups]).float() * tensors["scales"].float().t()[:, groups]
    assert torch.equal(read.dequantize(), expected) and torch.equal(read.dequantize(), qw.dequantize())


# --- which modules are quantized ----------------------------------------------------------------------------

def test_compressed_tensors_ignore_takes_names_and_patterns():
    config = quantization_config(CheckpointFormat("int-quantized"))
    config["ignore"] = ["lm_head", "re:.*mlp\\.gate$", "model.layers.0.self_attn.q_proj"]
    config = QuantizationConfig.from_hf(config)
    assert config.skips("lm_head") and config.skips("model.layers.3.mlp.gate")
    assert config.skips("model.layers.0.self_attn.q_proj") and not config.skips("model.layers.1.self_attn.q_proj")
    assert not config.skips("model.layers.3.mlp.gate_proj")
    linear = {"weight", "weight_scale"}
    assert config.is_quantized("model.layers.1.self_attn.q_proj", linear)
    assert not config.is_quantized("model.layers.0.self_attn.q_proj", {"weight"})  # ignored: float
    assert not config.is_quantized("model.layers.1.input_layernorm", {"weight"})  # a norm's weight
    assert "weight" in config.tensor_suffixes


def test_compressed_tensors_groups_pick_the_most_specific_target():
    config = quantization_config(CheckpointFormat("pack-quantized", group_size=32))
    eight_bit = json.loads(json.dumps(config["config_groups"]["group_0"]))
    eight_bit["targets"] = ["re:.*down_proj$"]
    eight_bit["weights"].update(num_bits=8, strategy="channel", group_size=None)
    config["config_groups"]["group_1"] = eight_bit
    config = QuantizationConfig.from_hf(config)
    assert config.scheme_for("model.layers.0.mlp.down_proj").bits == 8
    assert config.scheme_for("model.layers.0.mlp.up_proj").bits == 4


def test_gptq_leaves_lm_head_and_modules_to_not_convert_float():
    config = quantization_config(CheckpointFormat("gptq"))
    config["modules_to_not_convert"] = ["mlp.gate"]
    gptq = QuantizationConfig.from_hf(config)
    assert gptq.skips("lm_head") and gptq.skips("model.layers.0.mlp.gate")
    assert not gptq.skips("model.layers.0.mlp.experts.1.up_proj") and not gptq.skips("model.layers.0.mlp.gate_proj")
    assert gptq.is_quantized("model.layers.0.self_attn.k_proj", {"qweight", "qzeros", "scales", "g_idx"})
    assert not QuantizationConfig.from_hf({**config, "lm_head": True}).skips("lm_head")
    excluded = QuantizationConfig.from_hf({**config, "dynamic": {r"-:.*\.layers\.1\..*": {}}})
    assert excluded.skips("model.layers.1.mlp.up_proj") and not excluded.skips("model.layers.0.mlp.up_proj")
    awq = QuantizationConfig.from_hf({**quantization_config(CheckpointFormat("awq")), "modules_to_not_convert": ["visual"]})
    assert awq.skips("visual.blocks.0.attn.qkv") and not awq.skips("model.layers.0.self_attn.q_proj")


def test_gptq_quantizes_only_modules_in_block_to_quantize():
    config = {**quantization_config(CheckpointFormat("gptq")), "lm_head": True,
              "modules_in_block_to_quantize": [["self_attn.k_proj", "self_attn.v_proj", "self_attn.q_proj"],
                                               ["mlp.gate"]]}
    gptq = QuantizationConfig.from_hf(config)
    assert gptq.quantized_tensor("model.layers.2.self_attn.q_proj") == "model.layers.2.self_attn.q_proj.qweight"
    assert gptq.quantized_tensor("model.layers.2.mlp.gate") == "model.layers.2.mlp.gate.qweight"
    assert gptq.skips("model.layers.2.self_attn.o_proj") and gptq.skips("model.layers.2.mlp.gate_proj")
    assert gptq.quantized_tensor("model.layers.2.self_attn.o_proj") is None
    assert not gptq.skips("lm_head")  # outside the decoder layers the list names


def test_quantized_tensor_names_the_marker_each_format_stores():
    module = "model.layers.0.mlp.up_proj"
    expected = {"gptq": "qweight", "awq": "qweight", "pack-quantized": "weight_packed",
                "int-quantized": "weight_scale", "float-quantized": "weight_scale"}
    for method, marker in expected.items():
        config = QuantizationConfig.from_hf(quantization_config(CheckpointFormat(method)))
        assert config.quantized_tensor(module) == f"{module}.{marker}", method
        assert config.quantized_tensor("lm_head") is None, method


# --- refusals --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("config, message", [
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported; tpengine reads compressed"),
    ({**quantization_config(CheckpointFormat("gptq")), "bits": 3}, "GPTQ bits 3 is not supported"),
    ({**quantization_config(CheckpointFormat("gptq")), "checkpoint_format": "marlin"},
     "GPTQ checkpoint_format 'marlin' is not supported"),
    ({**quantization_config(CheckpointFormat("awq")), "version": "gemv"}, "AWQ version 'gemv' is not supported"),
    ({**quantization_config(CheckpointFormat("awq")), "zero_point": False}, "AWQ zero_point false"),
    (_with_inputs(quantization_config(CheckpointFormat("int-quantized")), dynamic=False),
     "static activation scales (input_scale) are not supported"),
    (_with_inputs(quantization_config(CheckpointFormat("int-quantized")), symmetric=False),
     "tpengine quantizes activations to symmetric int8"),
    ({**quantization_config(CheckpointFormat("pack-quantized")), "format": "nvfp4-pack-quantized"},
     "compressed-tensors format 'nvfp4-pack-quantized' is not supported"),
    (_with_weights(quantization_config(CheckpointFormat("pack-quantized")), num_bits=2),
     "2-bit weights are not supported"),
    ({**quantization_config(CheckpointFormat("pack-quantized")), "kv_cache_scheme": {"num_bits": 8}},
     "compressed-tensors kv_cache_scheme is not supported"),
])
def test_unsupported_configs_are_refused_by_name(config, message):
    with pytest.raises(ValueError) as error:
        QuantizationConfig.from_hf(config)
    assert message in str(error.value)


def test_inconsistent_tensors_are_refused_naming_module_and_tensor():
    _, tensors, config = _linear(CheckpointFormat("gptq", group_size=32), scale_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.up_proj.scales: shape \[2, 48\], expected \[4, 48\]"):
        config.read_linear("model.layers.0.mlp.up_proj", {**tensors, "scales": tensors["scales"][:2]})
    with pytest.raises(ValueError, match="model.layers.0.mlp.up_proj.qweight: dtype torch.int64"):
        config.read_linear("model.layers.0.mlp.up_proj", {**tensors, "qweight": tensors["qweight"].long()})
    with pytest.raises(ValueError, match="sym is true but the zero points are not all 8"):
        config.read_linear("model.layers.0.mlp.up_proj", {**tensors, "qzeros": tensors["qzeros"] + 1})
    _, tensors, config = _linear(CheckpointFormat("pack-quantized", group_size=32))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.up_proj.weight_packed: shape \[48, 16\], expected \[48, 32\]"):
        config.read_linear("model.layers.0.mlp.up_proj", {**tensors, "weight_shape": torch.tensor([OUT, 2 * IN])})
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.up_proj.weight_scale: shape \[48, 2\], expected \[48, 4\]"):
        config.read_linear("model.layers.0.mlp.up_proj", {**tensors, "weight_scale": tensors["weight_scale"][:, :2]})
    with pytest.raises(ValueError, match="model.layers.0.mlp.up_proj: missing tensor 'weight_scale'"):
        config.read_linear("model.layers.0.mlp.up_proj", {k: v for k, v in tensors.items() if k != "weight_scale"})


@pytest.mark.parametrize("fmt, suffix", [
    (CheckpointFormat("gptq", group_size=32), "scales"),
    (CheckpointFormat("awq", group_size=32), "scales"),
    (CheckpointFormat("pack-quantized", group_size=32, sym=False), "weight_scale"),
    (CheckpointFormat("int-quantized", group_size=None), "weight_scale"),
    (CheckpointFormat("float-quantized", fp8_strategy="tensor"), "weight_scale"),
], ids=lambda v: v.method if isinstance(v, CheckpointFormat) else None)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_a_non_finite_scale_is_refused_naming_the_tensor(fmt, suffix, value):
    _, tensors, config = _linear(fmt, scale_dtype=torch.float16 if fmt.method in ("gptq", "awq") else torch.float32)
    scale = tensors[suffix].clone()
    scale.view(-1)[-1] = value
    with pytest.raises(ValueError, match=rf"model.layers.0.mlp.up_proj.{suffix} has 1 non-finite values "
                                         r"\(NaN or Inf\): the checkpoint is corrupt"):
        config.read_linear("model.layers.0.mlp.up_proj", {**tensors, suffix: scale})


def test_an_mxfp4_scale_of_0xff_is_refused_as_nan_naming_the_tensor():
    config = QuantizationConfig.from_hf({"quant_method": "mxfp4"})
    blocks, scales = torch.zeros(2, 8, 2, 16, dtype=torch.uint8), torch.full((2, 8, 2), 127, dtype=torch.uint8)
    assert config.read_linear("model.layers.0.mlp.experts.down_proj", {"blocks": blocks, "scales": scales}).shape \
        == (2, 64, 8)
    scales[1, 3] = 0xFF  # e8m0's NaN
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts.down_proj_scales has 2 non-finite values"):
        config.read_linear("model.layers.0.mlp.experts.down_proj", {"blocks": blocks, "scales": scales})


# --- online quantization ------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits, group_size, largest", [(8, None, 127), (4, None, 7), (4, 32, 7), (8, 64, 127)])
def test_online_quantization_rounds_within_half_a_step(bits, group_size, largest):
    weight = _weight()
    qw = quantize_weight(weight, bits, group_size)
    expected_group_size = group_size or (IN if bits == 8 else 128)
    assert qw.group_size == expected_group_size and qw.scales.shape == (OUT, IN // expected_group_size)
    assert int(qw.qweight.max()) <= largest and int(qw.qweight.min()) >= (-127 if bits == 8 else -8)
    assert int(qw.qweight.abs().max()) == largest  # each group's largest magnitude lands on the edge
    step = qw.scales[:, qw.column_groups()]
    assert bool(((qw.dequantize() - weight).abs() <= step / 2 + 1e-6).all())
    assert not qw.dequantize().isnan().any() and bool((qw.dequantize()[3] == 0).all())


def test_online_quantization_refuses_groups_that_do_not_divide():
    with pytest.raises(ValueError, match="in_features 96 is not a multiple of the quantization group size 128"):
        quantize_weight(torch.randn(8, 96), 4)
    with pytest.raises(ValueError, match="3 bits is not supported"):
        quantize_weight(torch.randn(8, 96), 3)


# --- QuantizedWeight shards against the whole --------------------------------------------------------------

def _dense_from_contiguous(qw: QuantizedWeight, in_features: int) -> torch.Tensor:
    """The [out, in] weight a with_contiguous_groups result computes: its columns added into their inputs."""
    contiguous, inputs = qw.with_contiguous_groups()
    assert contiguous.group_index is None
    if inputs is None:
        return contiguous.dequantize()
    return torch.zeros(qw.shape[0], in_features).index_add_(1, inputs, contiguous.dequantize())


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("num_shards", [1, 2, 4])
def test_act_order_row_parallel_shards_compute_their_columns_of_the_whole(sym, num_shards):
    qw, _, _ = _linear(CheckpointFormat("gptq", group_size=32, desc_act=True, sym=sym), scale_dtype=torch.float16)
    whole = qw.dequantize()
    length = IN // num_shards
    for rank in range(num_shards):
        shard = qw.columns(rank * length, length, num_shards)
        assert torch.equal(shard.dequantize(), whole[:, rank * length:(rank + 1) * length])
        assert torch.equal(_dense_from_contiguous(shard, length), whole[:, rank * length:(rank + 1) * length])


def test_grouped_shards_compute_their_part_of_the_whole():
    qw, _, _ = _linear(CheckpointFormat("pack-quantized", group_size=32, sym=False))
    whole = qw.dequantize()
    assert torch.equal(qw.rows(8, 16).dequantize(), whole[8:24])
    assert torch.equal(qw.columns(64, 64, 2).dequantize(), whole[:, 64:])
    with pytest.raises(ValueError, match="each rank takes 16 input features, not a multiple of the group size 32"):
        qw.columns(16, 16, 8)
    channel, _, _ = _linear(CheckpointFormat("pack-quantized", group_size=None))
    assert torch.equal(channel.columns(32, 32, 4).dequantize(), channel.dequantize()[:, 32:64])


def test_cat_rows_joins_projections_each_with_its_scales():
    fmt = CheckpointFormat("gptq", group_size=32, desc_act=True)
    parts = [_linear(fmt, seed=seed, scale_dtype=torch.float16)[0] for seed in range(3)]
    same_order = [QuantizedWeight(p.bits, p.qweight, p.scales, p.zeros, p.group_size, parts[0].group_index)
                  for p in parts]
    joined = cat_rows(same_order)
    assert torch.equal(joined.dequantize(), torch.cat([p.dequantize() for p in same_order]))
    with pytest.raises(ValueError, match="different act-order group indices"):
        cat_rows(parts)
    with pytest.raises(ValueError, match="quantized differently"):
        cat_rows([parts[0], quantize_weight(_weight(), 8)])


def test_cat_rows_joins_groups_of_different_sizes_widths_zeros_and_minimums_exactly():
    """A GGUF layer's Q4_K q (int4 over zero points, a minimum per 32) beside its Q6_K v (int8, a scale per 16)."""
    q = quantize_weight(_weight(), 4, group_size=32)
    q = replace(q, zeros=torch.full_like(q.scales, -8.0), minimums=torch.randn_like(q.scales))
    v = quantize_weight(_weight(), 8, group_size=16)
    joined = cat_rows([q, v])
    assert (joined.bits, joined.group_size) == (8, 16)
    assert torch.equal(joined.dequantize(), torch.cat([q.dequantize(), v.dequantize()]))
    assert torch.equal(joined.columns(64, 64, 2).dequantize(), joined.dequantize()[:, 64:])


# --- whole checkpoints --------------------------------------------------------------------------------------

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def tiny_float_model(tmp_path_factory) -> str:
    from tpengine.tiny_model import write_tiny_model
    return write_tiny_model(str(tmp_path_factory.mktemp("float")), seed=3, with_tokenizer=False, **TINY)


def _read_back(quantized_dir: str) -> tuple[dict, dict]:
    with open(f"{quantized_dir}/config.json") as f:
        config = QuantizationConfig.from_hf(json.load(f)["quantization_config"])
    modules = {}
    for name, tensor in load_file(f"{quantized_dir}/model.safetensors").items():
        module, _, suffix = name.rpartition(".")
        modules.setdefault(module, {})[suffix] = tensor
    read = {module: config.read_linear(module, tensors) for module, tensors in modules.items()
            if config.is_quantized(module, set(tensors))}
    return read, modules


@pytest.mark.parametrize("fmt", [
    CheckpointFormat("pack-quantized", group_size=32, sym=False, desc_act=True),
    CheckpointFormat("pack-quantized", bits=8, group_size=None),
    CheckpointFormat("int-quantized", group_size=None),
    CheckpointFormat("float-quantized"),
    CheckpointFormat("gptq", bits=4, group_size=32, desc_act=True, sym=False),
    CheckpointFormat("gptq", bits=8, group_size=None, checkpoint_format="gptq_v2"),
    CheckpointFormat("awq", group_size=64),
], ids=lambda fmt: f"{fmt.method}-{fmt.bits}")
def test_written_checkpoint_reads_back_as_its_reference(tiny_float_model, tmp_path, fmt):
    written = write_quantized_and_reference(tiny_float_model, str(tmp_path / "q"), str(tmp_path / "ref"), fmt)
    read, modules = _read_back(str(tmp_path / "q"))
    reference = load_file(str(tmp_path / "ref" / "model.safetensors"))
    assert set(read) == set(written) == {m for m in modules if QUANTIZED_LINEAR.match(m)}
    assert len(read) == 7 * TINY["num_hidden_layers"]
    for module, value in read.items():
        weight = value if isinstance(value, torch.Tensor) else value.dequantize()
        assert torch.equal(weight, reference[f"{module}.weight"]), module
    assert set(modules["lm_head"]) == {"weight"} and modules["lm_head"]["weight"].is_floating_point()
    with open(tmp_path / "ref" / "config.json") as f:
        assert "quantization_config" not in json.load(f)


def test_reference_checkpoint_runs_in_transformers(tiny_float_model, tmp_path):
    from transformers import AutoModelForCausalLM
    write_quantized_and_reference(tiny_float_model, str(tmp_path / "q"), str(tmp_path / "ref"),
                                  CheckpointFormat("gptq", group_size=32))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ref"), dtype=torch.float32)
    reference = load_file(str(tmp_path / "ref" / "model.safetensors"))
    assert torch.equal(model.model.layers[1].mlp.up_proj.weight, reference["model.layers.1.mlp.up_proj.weight"])
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, TINY["vocab_size"]) and bool(logits.isfinite().all())


def test_moe_experts_are_quantized_and_the_router_is_not(tmp_path):
    from tpengine.tiny_model import write_tiny_model
    float_dir = write_tiny_model(str(tmp_path / "moe"), seed=4, with_tokenizer=False, architecture="Qwen3MoeForCausalLM",
                                 **{**TINY, "num_hidden_layers": 1}, moe_intermediate_size=32, num_experts=4,
                                 num_experts_per_tok=2)
    written = write_quantized_and_reference(float_dir, str(tmp_path / "q"), str(tmp_path / "ref"),
                                            CheckpointFormat("awq", group_size=32))
    read, modules = _read_back(str(tmp_path / "q"))
    assert set(read) == set(written)
    assert {f"model.layers.0.mlp.experts.{e}.{p}_proj" for e in range(4) for p in ("gate", "up", "down")} <= set(read)
    assert set(modules["model.layers.0.mlp.gate"]) == {"weight"}
