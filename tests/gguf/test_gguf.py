"""GGUF files load as llama.cpp wrote them and run exactly: greedy tokens equal transformers' reading the same file
(every tensor dequantized) in float32, each tensor run from its own type; bad files are ValueErrors naming what is
wrong, before any worker starts."""
import json
import os
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from tests.conftest import random_prompts
from tests.gguf.oracle import transformers_greedy
from tests.gguf.writer import write_gguf
from tpengine import LLM, SamplingParams
from tpengine.gguf.files import open_gguf
from tpengine.gguf.tensors import checkpoint_tensors, unpermute_rows
from tpengine.hf_config import load_hf_config
from tpengine.quantization.weights import QuantizedWeight
from tpengine.tiny_model import write_tiny_model

# transformers reads no qwen3.attention.key_length: its Qwen3Config's default head_dim (128) must be the model's
QWEN3 = dict(num_hidden_layers=2, head_dim=128, tie_word_embeddings=False)
LLAMA = dict(architecture="LlamaForCausalLM", num_hidden_layers=2, head_dim=None, tie_word_embeddings=True,
             bos_token="<|begin_of_text|>")
QWEN3_MOE = dict(QWEN3, architecture="Qwen3MoeForCausalLM", moe_intermediate_size=64, num_experts=4,
                 num_experts_per_tok=2, norm_topk_prob=True)
# Llama 3.1's rope scaling with a pre-training window of 64 (given at the top level too, where llama.cpp's converter
# reads it), so that a short prompt's low frequencies are scaled, and some blended
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)
# llama.cpp's Gemma 2 graph scales queries by 1/sqrt(head_dim) (query_pre_attn_scalar is not in the file); a window
# shorter than the prompts
GEMMA2 = dict(architecture="Gemma2ForCausalLM", num_hidden_layers=4, head_dim=32, query_pre_attn_scalar=32,
              sliding_window=16, attn_logit_softcapping=50.0, final_logit_softcapping=30.0, bos_token="<bos>")
# six layers, the sixth global (llama.cpp's gemma3 pattern); the global layers' rope scaled linearly, as Gemma 3 4B's
GEMMA3 = dict(GEMMA2, architecture="Gemma3ForCausalLM", num_hidden_layers=6, final_logit_softcapping=None,
              attn_logit_softcapping=None, rope_parameters={
                  "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                  "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> str:
    return write_tiny_model(str(tmp_path_factory.mktemp("qwen3")), seed=3, **QWEN3)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return write_tiny_model(str(tmp_path_factory.mktemp("llama")), seed=4, **LLAMA)


def _greedy(path: str, prompts, **kwargs):
    with LLM(path, kvcache_block_size=16, **{"gguf_activations": "float", **kwargs}) as llm:  # the exact mode
        return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("weight_type", ["F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_qwen3_gguf_greedy_tokens_equal_transformers_reading_the_same_file(qwen3, tmp_path, weight_type):
    path = write_gguf(qwen3, str(tmp_path / f"model-{weight_type}.gguf"), weight_type)
    prompts = random_prompts(3, [5, 20], 320)
    assert _greedy(path, prompts) == transformers_greedy(path, prompts, 8)


# the byte offsets of each block's float16 scales and minimums: every other byte pattern is a valid block
FLOAT16_OFFSETS = {"Q4_1": (0, 2), "Q5_1": (0, 2), "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2),
                   "IQ4_NL": (0,), "IQ4_XS": (0,), "MXFP4": ()}  # MXFP4: any byte is an e8m0 exponent


@pytest.mark.parametrize("weight_type", list(FLOAT16_OFFSETS))
def test_blocks_of_any_bytes_unpack_to_what_gguf_dequantizes(weight_type):
    """Random bytes, finite float16 scales and minimums set at random per block."""
    from gguf import GGML_QUANT_SIZES, dequantize
    from tpengine.gguf.tensors import _READERS
    kind = GGMLQuantizationType[weight_type]
    values_per_block, block_bytes = GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, size=(6, 512 // values_per_block, block_bytes), dtype=np.uint8)
    for offset in FLOAT16_OFFSETS[weight_type]:
        scales = rng.uniform(-0.05, 0.05, size=blocks.shape[:2]).astype(np.float16)
        blocks[..., offset:offset + 2] = scales[..., None].view(np.uint8)
    blocks = blocks.reshape(6, -1)
    assert torch.equal(_READERS[weight_type](blocks).dequantize(), torch.from_numpy(dequantize(blocks, kind)))


@pytest.mark.parametrize("weight_type", ["Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_block_types_unpack_to_what_gguf_dequantizes(weight_type):
    """Blocks quantized from weights: by gguf where it quantizes the type, else by the writer from the layout."""
    from gguf import dequantize
    from tests.gguf.writer import _quantized
    from tpengine.gguf.tensors import _READERS
    weights = np.random.default_rng(0).standard_normal((6, 512)).astype(np.float32)
    kind = GGMLQuantizationType[weight_type]
    blocks = _quantized(weights, kind)
    unpacked = _READERS[weight_type](blocks).dequantize()
    assert torch.equal(unpacked, torch.from_numpy(dequantize(blocks, kind)))
    rough = weight_type in ("Q2_K", "Q3_K")  # the blocks stand for the weights, 2 and 3 bits only roughly
    assert float((unpacked - torch.from_numpy(weights)).abs().mean()) < (0.3 if rough else 0.1)


# K-quant super-blocks span 256 inputs: every input width a multiple of 256 (o_proj's per-rank half at tp 2 cuts a
# super-block, not a group of 16 or 32); an odd vocabulary, so that tp 2 pads the embedding's last shard
WIDE = dict(QWEN3, hidden_size=256, intermediate_size=512, num_attention_heads=2, num_key_value_heads=1)


def test_q6_k_file_runs_as_6_bit_values_with_a_scale_per_16_and_equals_transformers_at_tp_1_and_2(tmp_path):
    folder = write_tiny_model(str(tmp_path / "wide"), seed=5, **WIDE)
    path = write_gguf(folder, str(tmp_path / "model-Q6_K.gguf"), "Q6_K")
    prompts = random_prompts(3, [5, 20], 320)
    expected = transformers_greedy(path, prompts, 8)
    assert _greedy(path, prompts) == expected
    assert _greedy(path, prompts, tensor_parallel_size=2) == expected


# Q4_K_M as llama.cpp mixes it: Q4_K, with Q6_K for some layers' attn_v and ffn_down and for the head; the second mix
# puts every other type with a minimum beside Q3_K; q/k/v and gate/up join types of different groups and forms
MIXES = {"Q4_K_M": ("Q4_K", {"blk.0.attn_v.weight": "Q6_K", "blk.1.ffn_down.weight": "Q6_K",
                              "output.weight": "Q6_K"}),
         "Q5_K_Q4_1_Q5_1_Q2_K_Q3_K": ("Q5_K", {"blk.0.attn_q.weight": "Q4_1", "blk.0.attn_k.weight": "Q5_1",
                                                "blk.0.attn_v.weight": "Q3_K", "blk.0.ffn_gate.weight": "Q2_K",
                                                "blk.1.ffn_up.weight": "Q3_K", "blk.1.attn_output.weight": "Q2_K",
                                                "token_embd.weight": "Q4_1", "output.weight": "Q5_1"})}


@pytest.mark.parametrize("mix", list(MIXES))
def test_k_quant_mixes_with_minimums_equal_transformers_reading_the_same_file_at_tp_1_and_2(tmp_path, mix):
    folder = write_tiny_model(str(tmp_path / "wide"), seed=8, **dict(WIDE, vocab_size=321))
    weight_type, types = MIXES[mix]
    path = write_gguf(folder, str(tmp_path / f"model-{mix}.gguf"), weight_type, types=types)
    read = {name: read() for name, _, read in checkpoint_tensors(open_gguf(path))}
    assert read["token_embd.weight"].minimums is not None  # a quantized table with minimums: rows gathered so
    prompts = random_prompts(3, [5, 20], 320)
    expected = transformers_greedy(path, prompts, 8)
    assert _greedy(path, prompts) == expected
    assert _greedy(path, prompts, tensor_parallel_size=2) == expected


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_by_default_the_cpu_quantizes_each_tokens_input_as_llama_cpp_near_the_dequantized_oracle(tmp_path, tp):
    """gguf_activations="auto" on the CPU: every block-quantized linear (the head too) takes each token's input
    quantized to int8, as llama.cpp's dot products do. Rated teacher-forced by transformers on the file's dequantized
    weights with each linear's input so quantized (a row-parallel one's per rank): within 0.1 nats of its best at
    every step, the log-probabilities agreeing."""
    from tests.models.test_quantized_models import assert_near_oracle, greedy_with_logprobs, int8_input_oracle
    from tests.gguf.oracle import transformers_from_dequantized
    folder = write_tiny_model(str(tmp_path / "wide"), seed=8, **dict(WIDE, vocab_size=321))
    weight_type, types = MIXES["Q4_K_M"]
    path = write_gguf(folder, str(tmp_path / "model-Q4_K_M.gguf"), weight_type, types=types)
    reference = str(tmp_path / "dequantized")
    transformers_from_dequantized(path, folder).save_pretrained(reference)
    prompts = random_prompts(3, [5, 20], 320)
    with LLM(path, kvcache_block_size=16, tensor_parallel_size=tp) as llm:
        results = greedy_with_logprobs(llm, prompts)
    assert_near_oracle(int8_input_oracle(reference, lambda name: True, tp), prompts, results)


def test_llama_gguf_with_permuted_qk_and_mixed_types_equals_transformers_at_tp_1_and_2(llama, tmp_path):
    types = {"blk.0.attn_q.weight": "Q4_0", "blk.1.ffn_down.weight": "F16", "token_embd.weight": "F32"}
    path = write_gguf(llama, str(tmp_path / "llama.gguf"), "Q8_0", types=types)
    prompts = random_prompts(3, [5, 20], 320)
    expected = transformers_greedy(path, prompts, 8)
    assert _greedy(path, prompts) == expected
    assert _greedy(path, prompts, tensor_parallel_size=2) == expected


def test_qwen3_moe_gguf_with_stacked_experts_equals_transformers_at_tp_1_and_2(tmp_path):
    folder = write_tiny_model(str(tmp_path / "moe"), seed=5, **QWEN3_MOE)
    path = write_gguf(folder, str(tmp_path / "moe.gguf"), "Q8_0", types={"blk.1.ffn_up_exps.weight": "Q4_0"})
    prompts = random_prompts(3, [5, 20], 320)
    expected = transformers_greedy(path, prompts, 8, dequantized_into=folder)
    assert _greedy(path, prompts) == expected
    assert _greedy(path, prompts, tensor_parallel_size=2) == expected


def test_llama3_rope_freqs_gguf_equals_transformers_reading_it_with_the_original_config(tmp_path):
    folder = write_tiny_model(str(tmp_path / "llama3"), seed=6, **LLAMA, original_max_position_embeddings=64,
                              rope_parameters=LLAMA3_ROPE)
    path = write_gguf(folder, str(tmp_path / "llama3.gguf"), "Q8_0")
    assert "rope_freqs.weight" in open_gguf(path).tensors
    prompts = random_prompts(3, [20, 40], 320)
    expected = transformers_greedy(path, prompts, 8, config_folder=folder)
    assert _greedy(path, prompts) == expected
    assert _greedy(path, prompts, tensor_parallel_size=2) == expected


@pytest.mark.parametrize("rope", [dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,  # Llama 3.1's
                                       original_max_position_embeddings=8192),
                                  dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,  # Llama 3.2's
                                       original_max_position_embeddings=8192),
                                  dict(factor=16.0, low_freq_factor=1.0, high_freq_factor=2.0,
                                       original_max_position_embeddings=128)])
def test_llama3_rope_scaling_is_read_back_from_the_rope_freqs_tensor(tmp_path, rope):
    rope = dict(rope, rope_type="llama3", rope_theta=500000.0)
    folder = write_tiny_model(str(tmp_path / "llama3"), seed=6, **dict(LLAMA, head_dim=64),
                              original_max_position_embeddings=rope["original_max_position_embeddings"],
                              rope_parameters=rope)
    config = load_hf_config(write_gguf(folder, str(tmp_path / "llama3.gguf"), "F16", tokenizer=False))
    assert config.rope_parameters == rope


def test_rope_freqs_no_llama3_rope_gives_is_a_value_error(tmp_path):
    from gguf import GGUFReader
    folder = write_tiny_model(str(tmp_path / "llama3"), seed=6, **LLAMA, rope_parameters=LLAMA3_ROPE)
    path = write_gguf(folder, str(tmp_path / "llama3.gguf"), "F16", tokenizer=False)
    GGUFReader(path, "r+").tensors[0].data[:] = np.linspace(1, 3, 16)  # rope_freqs, written before the weights
    with pytest.raises(ValueError, match="'rope_freqs.weight' holds per-frequency rope factors that no llama3"):
        load_hf_config(path)


# Phi-3: fused qkv_proj and gate_up_proj (pad inside the vocabulary: Phi3Config's 32000 is past it); Phi-4-mini:
# 12 of 16 dimensions rotated, LongRoPE past a 32-token window, a tied head
PHI3 = dict(architecture="Phi3ForCausalLM", num_hidden_layers=2, hidden_size=64, head_dim=16, pad_token_id=0,
            tie_word_embeddings=False)
PHI4_MINI = dict(PHI3, partial_rotary_factor=0.75, original_max_position_embeddings=32, tie_word_embeddings=True,
                 rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
                                      short_factor=[1.0 + 0.25 * i for i in range(6)],
                                      long_factor=[2.0 + 3.0 * i for i in range(6)]))


@pytest.mark.parametrize("settings", [PHI3, PHI4_MINI], ids=["phi3", "phi4_mini"])
def test_phi3_gguf_with_fused_qkv_and_gate_up_equals_transformers_at_tp_1_and_2(tmp_path, settings):
    """llama.cpp keeps Phi-3's q/k/v (attn_qkv) and gate/up (ffn_up) fused; Phi-4-mini's LongRoPE factors are
    tensors and its partial rotation the rope dimension count. transformers reads the config from the folder (its
    GGUF config drops both, and takes Phi3Config's pad id 32000), the weights from the file."""
    folder = write_tiny_model(str(tmp_path / "phi3"), seed=8, **settings)
    path = write_gguf(folder, str(tmp_path / "phi3.gguf"), "Q8_0", types={"blk.0.attn_qkv.weight": "Q4_0",
                                                                          "blk.1.ffn_up.weight": "Q5_1"})
    prompts = random_prompts(3, [5, 48], 320)  # past the 32-token window: the long factors
    expected = transformers_greedy(path, prompts, 8, config_folder=folder)
    assert _greedy(path, prompts) == expected
    assert _greedy(path, prompts, tensor_parallel_size=2) == expected


# gpt-oss with its own swiglu constants (llama.cpp's graph fixes gpt-oss's 1.702 and 7.0: the file keeps none), a
# 16-token window on its sliding layers, no rope scaling
GPT_OSS = dict(architecture="GptOssForCausalLM", hidden_size=64, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
               sliding_window=16, max_position_embeddings=256, pad_token_id=0, tie_word_embeddings=False,
               rope_parameters=dict(rope_type="default", rope_theta=150000.0), initializer_range=0.1)


def test_gpt_oss_gguf_with_mxfp4_experts_equals_transformers_at_tp_1_and_2(tmp_path):
    """llama.cpp's gpt-oss file: each expert projection MXFP4 (run as int8 values, a power-of-two scale per 32) with
    gate and up apart, their biases stacked, the sinks and router under their GGUF names. transformers reads neither
    the split experts nor the sinks from such a file: the oracle is the checkpoint's model with the file's
    dequantized tensors put back in its layout."""
    folder = write_tiny_model(str(tmp_path / "gpt_oss"), seed=5, **GPT_OSS)
    types = {f"blk.{layer}.ffn_{projection}_exps.weight": "MXFP4" for layer in range(2)
             for projection in ("gate", "up", "down")}
    path = write_gguf(folder, str(tmp_path / "gpt_oss.gguf"), "Q8_0", types=types)
    prompts = random_prompts(3, [5, 40], 320)  # past the window
    expected = transformers_greedy(path, prompts, 8, dequantized_into=folder)
    assert _greedy(path, prompts) == expected
    assert _greedy(path, prompts, tensor_parallel_size=2) == expected


@pytest.mark.parametrize("settings", [GEMMA2, GEMMA3], ids=["gemma2", "gemma3"])
def test_gemma_gguf_with_norms_stored_plus_one_equals_transformers_at_tp_1_and_2(tmp_path, settings):
    folder = _with_random_norms(write_tiny_model(str(tmp_path / "gemma"), seed=7, **settings))
    path = write_gguf(folder, str(tmp_path / "gemma.gguf"), "Q8_0", types={"blk.1.attn_v.weight": "Q4_0"})
    fields = ("rope_parameters", "layer_types", "sliding_window", "query_pre_attn_scalar", "head_dim",
              "attn_logit_softcapping", "final_logit_softcapping", "tie_word_embeddings")
    from_file, from_folder = load_hf_config(path), load_hf_config(folder)
    assert [getattr(from_file, f) for f in fields] == [getattr(from_folder, f) for f in fields]
    norm = open_gguf(path).tensors["blk.0.post_ffw_norm.weight"]
    assert np.abs(np.array(norm.data) - 1).max() < 0.5  # written as w + 1, as llama.cpp writes Gemma's norms
    prompts = random_prompts(3, [20, 40], 320)
    expected = transformers_greedy(path, prompts, 8, config_folder=folder)  # it reads no query_pre_attn_scalar
    assert _greedy(path, prompts) == expected
    assert _greedy(path, prompts, tensor_parallel_size=2) == expected


def _with_random_norms(folder: str) -> str:
    """The checkpoint's norm weights (zero as transformers initialises Gemma's) drawn at random, so the +1 counts."""
    from safetensors.numpy import load_file, save_file
    file = os.path.join(folder, "model.safetensors")
    tensors = load_file(file)
    rng = np.random.default_rng(0)
    for name, weights in tensors.items():
        if name.endswith("norm.weight"):
            tensors[name] = rng.normal(0, 0.1, weights.shape).astype(weights.dtype)
    save_file(tensors, file, metadata={"format": "pt"})
    return folder


def test_block_types_load_as_their_exact_quantized_form(qwen3, tmp_path):
    path = write_gguf(qwen3, str(tmp_path / "m.gguf"), "Q8_0", types={"blk.0.ffn_up.weight": "Q4_0"})
    checkpoint = open_gguf(path)
    read = {gguf_name: read() for gguf_name, _, read in checkpoint_tensors(checkpoint)}
    for name, bits in (("blk.0.attn_q.weight", 8), ("blk.0.ffn_up.weight", 4)):
        tensor = checkpoint.tensors[name]
        assert isinstance(read[name], QuantizedWeight) and read[name].bits == bits and read[name].group_size == 32
        expected = quants.dequantize(tensor.data, tensor.tensor_type)
        np.testing.assert_array_equal(read[name].dequantize().numpy(), expected)


def test_unpermute_rows_undoes_llama_cpps_permutation():
    from tests.gguf.writer import permute
    rows = np.arange(8 * 4 * 3, dtype=np.float32).reshape(8 * 4, 3)
    np.testing.assert_array_equal(unpermute_rows(permute(rows, 4), 4), rows)


def test_config_and_tokenizer_come_from_the_file_alone(qwen3, tmp_path):
    path = write_gguf(qwen3, str(tmp_path / "alone.gguf"), "F16")
    config = load_hf_config(path)
    assert (config.model_type, config.head_dim, config.num_key_value_heads, config.tie_word_embeddings) == \
        ("qwen3", 128, 2, False)
    with LLM(path, kvcache_block_size=16) as llm:
        tokenizer = llm.get_tokenizer()
        assert tokenizer.decode(tokenizer.encode("hi there")) == "hi there"
        assert tokenizer.chat_template and tokenizer.eos_token_id == 256
        assert llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)[0].outputs[0].text is not None


def test_a_split_set_loads_from_any_of_its_files(qwen3, tmp_path):
    whole = write_gguf(qwen3, str(tmp_path / "whole.gguf"), "Q8_0")
    first = _split(whole, tmp_path / "split")
    prompts = random_prompts(2, [5, 12], 320)
    assert _greedy(first, prompts) == _greedy(whole, prompts)


def _split(path: str, folder) -> str:
    """The file rewritten as a split set of three, as gguf-split writes one: metadata in the first file."""
    from gguf import GGUFReader, GGUFWriter
    reader = GGUFReader(path)
    os.makedirs(folder)
    writer = GGUFWriter(str(folder / "m.gguf"), "qwen3", split_max_tensors=10)
    for key, field in reader.fields.items():
        if not key.startswith(("GGUF.", "general.architecture")):
            writer.add_key_value(key, field.contents(), field.types[0],
                                 sub_type=field.types[-1] if len(field.types) > 1 else None)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    files = sorted(os.listdir(folder))
    assert len(files) > 1 and files[0].endswith("-00001-of-%05d.gguf" % len(files))
    return str(folder / files[-1])


def test_a_type_without_a_kernel_is_a_value_error_naming_it_and_the_tensor(qwen3, tmp_path):
    path = write_gguf(qwen3, str(tmp_path / "k.gguf"), "Q8_0", types={"blk.1.attn_output.weight": "Q8_1"})
    with pytest.raises(ValueError, match="'blk.1.attn_output.weight' is of type Q8_1"):
        LLM(path)


def test_a_truncated_file_is_a_value_error_naming_it(qwen3, tmp_path):
    path = write_gguf(qwen3, str(tmp_path / "cut.gguf"), "Q8_0")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(ValueError, match="cut.gguf is not a readable GGUF file"):
        LLM(path)


def test_an_unknown_architecture_is_a_value_error_naming_it(qwen3, tmp_path):
    path = write_gguf(qwen3, str(tmp_path / "bert.gguf"), "F16", arch="bert")
    with pytest.raises(ValueError, match="GGUF architecture 'bert'.*general.architecture"):
        load_hf_config(path)


def test_a_tensor_shape_that_disagrees_with_the_metadata_is_a_value_error_naming_it(qwen3, tmp_path):
    bad = str(tmp_path / "bad")
    shutil.copytree(qwen3, bad)
    with open(os.path.join(bad, "config.json")) as f:
        config = json.load(f)
    config["intermediate_size"] = 512  # the metadata says 512, the tensors hold 384
    with open(os.path.join(bad, "config.json"), "w") as f:
        json.dump(config, f)
    path = write_gguf(bad, str(tmp_path / "shape.gguf"), "Q8_0")
    with pytest.raises(ValueError, match="GGUF tensor 'blk.0.ffn_(gate|up|down).weight' has shape .*384.*512"):
        load_hf_config(path)


def test_a_file_without_a_tokenizer_needs_the_tokenizer_setting(qwen3, tmp_path):
    path = write_gguf(qwen3, str(tmp_path / "notok.gguf"), "F16", tokenizer=False)
    with pytest.raises(ValueError, match="holds no tokenizer.*tokenizer.ggml.model.*--tokenizer"):
        LLM(path)
    with LLM(path, tokenizer=qwen3, kvcache_block_size=16) as llm:
        assert llm.get_tokenizer().eos_token_id == 256


def test_splitting_a_block_at_tp_2_is_a_value_error_naming_both_numbers():
    weight = QuantizedWeight(bits=8, qweight=torch.zeros(4, 96, dtype=torch.int8), scales=torch.ones(4, 3), zeros=None,
                             group_size=32)
    with pytest.raises(ValueError, match="48 input features, not a multiple of the group size 32"):
        weight.columns(0, 48, 2)


def test_serve_chats_with_a_gguf_file_and_nothing_else_on_disk(qwen3, tmp_path):
    from tests.entrypoints.conftest import Server
    path = write_gguf(qwen3, str(tmp_path / "served.gguf"), "Q8_0")
    server = Server("--model", path, "--block-size", "16")
    try:
        body = {"model": Server.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        status, reply = server.request("POST", "/v1/chat/completions", body)
        assert status == 200 and reply["usage"]["completion_tokens"] >= 1
        assert server.stop() == 0
    finally:
        server.kill_leftovers()
