"""The `tpengine` command: generate (args, stdin, --json, --tp) and make-tiny-model."""
import hashlib
import json
import os
import re
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from tests.conftest import hf_greedy
from tpengine.cli import _engine_kwargs, build_parser, flag_reference, main
from tpengine.config import SETTING_GROUPS, EngineConfig, engine_fields


def _json_lines(text):
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_help_documents_every_generate_flag(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = capsys.readouterr().out
    for flag in ("--model", "--tp", "--max-tokens", "--temperature", "--json", "--file", "--block-size",
                 "--attention-backend", "--enforce-eager", "--device", "--dtype"):
        assert flag in help_text


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_launch_scripts_take_every_flag_of_their_command(command, capsys):
    def flags(parser) -> set[str]:
        with pytest.raises(SystemExit):
            parser.parse_args([command, "--help"])
        return set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", capsys.readouterr().out))

    assert flags(build_parser(under_torchrun=True)) == flags(build_parser())
    # under torchrun --tp defaults to the world size over --pp
    args = build_parser(under_torchrun=True).parse_args([command, "--pp", "2"])
    assert args.tensor_parallel_size is None and args.pipeline_parallel_size == 2 and args.pp_layer_partition is None
    assert build_parser().parse_args([command, "--pp-layer-partition", "3,1"]).pp_layer_partition == [3, 1]
    # a count that starts with '-' is a value, for the engine to refuse by name, not a flag
    assert build_parser().parse_args([command, "--pp-layer-partition", "-1,5"]).pp_layer_partition == [-1, 5]
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([command, "--pp-layer-partition", "3,x"])
    assert exit_info.value.code == 2 and "comma-separated layer counts" in capsys.readouterr().err


def test_generate_json_matches_transformers(tied_model, capsys):
    assert main(["generate", "--model", tied_model, "--max-tokens", "6", "--ignore-eos", "--json", "--quiet",
                 "--block-size", "16", "Hello", "tensor parallel"]) == 0
    outputs = _json_lines(capsys.readouterr().out)
    assert [o["prompt"] for o in outputs] == ["Hello", "tensor parallel"]
    expected = hf_greedy(tied_model, [o["prompt_token_ids"] for o in outputs], 6)
    assert [o["token_ids"] for o in outputs] == expected


def test_generate_with_ngram_speculation_matches_transformers(tied_model, capsys):
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}'
    assert main(["generate", "--model", tied_model, "--max-tokens", "24", "--ignore-eos", "--json", "--quiet",
                 "--block-size", "16", "--speculative-config", spec, "Hello Hello Hello", "ab ab ab ab"]) == 0
    outputs = _json_lines(capsys.readouterr().out)
    expected = hf_greedy(tied_model, [o["prompt_token_ids"] for o in outputs], 24)
    assert [o["token_ids"] for o in outputs] == expected


def test_prompts_from_a_file(tied_model, tmp_path, capsys):
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("first prompt\n\nsecond prompt\n")
    assert main(["generate", "--model", tied_model, "--max-tokens", "2", "--json", "--quiet",
                 "--file", str(prompts_file)]) == 0
    assert [o["prompt"] for o in _json_lines(capsys.readouterr().out)] == ["first prompt", "second prompt"]


def test_bad_setting_is_a_clear_error_not_a_traceback(tied_model, capsys):
    assert main(["generate", "--model", tied_model, "--block-size", "24", "--quiet", "hi"]) == 2
    err = capsys.readouterr().err
    assert "kvcache_block_size must be a power of two >= 16" in err and "Traceback" not in err


def test_make_tiny_model_is_deterministic(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TPENGINE_TINY_MODEL_CACHE", "0")  # two writes by transformers, not a write and its copy
    digests = []
    for name in ("a", "b"):
        assert main(["make-tiny-model", str(tmp_path / name)]) == 0
        with open(tmp_path / name / "model.safetensors", "rb") as f:
            digests.append(hashlib.sha256(f.read()).hexdigest())
    assert digests[0] == digests[1]
    assert os.path.exists(tmp_path / "a" / "tokenizer.json")


def test_default_model_from_stdin_at_tp_2_says_it_is_the_tiny_model(tmp_path):
    from tpengine.cache import cache_dir
    # the model is written into the fresh cache folder; the C++ kernels built once for this machine are reused
    # (an empty kernels folder would build them all again: a minute and a half on 2 cores)
    if os.path.isdir(cache_dir("kernels")):
        os.symlink(cache_dir("kernels"), tmp_path / "kernels")
    env = {**os.environ, "TPENGINE_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "tpengine.cli", "generate", "--tp", "2", "--max-tokens", "4",
                             "--ignore-eos", "--json"], input="one\ntwo\n", capture_output=True, text=True, env=env,
                            timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tiny random-weight Qwen3" in result.stderr and "meaningless" in result.stderr
    outputs = _json_lines(result.stdout)
    assert [o["prompt"] for o in outputs] == ["one", "two"]
    [model] = [str(path) for path in tmp_path.iterdir() if path.name.startswith("tiny-qwen3")]
    tokenizer = AutoTokenizer.from_pretrained(model)
    assert [o["prompt_token_ids"] for o in outputs] == [tokenizer.encode("one"), tokenizer.encode("two")]
    assert [o["token_ids"] for o in outputs] == hf_greedy(model, [o["prompt_token_ids"] for o in outputs], 4)


@pytest.mark.parametrize("argv, message", [
    (["--file", "/nonexistent/prompts.txt"], "cannot read prompts from --file /nonexistent/prompts.txt: No such file"),
    (["--file", "/"], "cannot read prompts from --file /: Is a directory"),
    (["--tp", "two", "hi"], "argument --tp: invalid int value"),
    (["--json", "--stream", "hi"], "not allowed with"),
    (["--n", "0", "hi"], "n must be >= 1"),
    (["--stop", "", "hi"], "stop strings must not be empty"),
    (["--speculative-config", "ngram", "hi"], "argument --speculative-config: not JSON"),
    (["--speculative-config", '{"model": "/no/such/draft", "num_speculative_tokens": 2}', "hi"],
     "/no/such/draft"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 100000}', "hi"],
     "num_speculative_tokens=100000 is more than the limit of 32"),
    (["--pp", "2", "--pp-layer-partition", "-1,5", "hi"], "pp_layer_partition=[-1, 5] must be 2 counts >= 1"),
])
def test_user_mistakes_print_one_error_line_and_exit_2(tied_model, capsys, argv, message):
    try:
        code = main(["generate", "--model", tied_model, "--quiet", *argv])
    except SystemExit as e:  # argparse's own checks
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("tpengine: error: ") and message in err and "Traceback" not in err


def test_empty_standard_input_says_no_prompts_and_exits_2(tied_model):
    result = subprocess.run([sys.executable, "-m", "tpengine.cli", "generate", "--model", tied_model, "--quiet"],
                            input="", capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.strip() == (
        "tpengine: error: no prompts: give them as arguments, with --file, or on standard input")


def test_an_unwritable_cache_folder_is_an_error_not_a_traceback(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = {**os.environ, "TPENGINE_CACHE_DIR": str(blocker / "cache")}
    result = subprocess.run([sys.executable, "-m", "tpengine.cli", "generate", "hi"], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "tpengine: error: cannot write the embedded tiny model into the cache folder" in result.stderr


def test_json_carries_every_completion_with_stop_reasons_and_logprobs(tied_model, capsys):
    assert main(["generate", "--model", tied_model, "--quiet", "--json", "--max-tokens", "5", "--ignore-eos",
                 "--n", "2", "--temperature", "1", "--seed", "4", "--logprobs", "2", "--stop", "zzz", "Hello"]) == 0
    [out] = _json_lines(capsys.readouterr().out)
    assert [c["index"] for c in out["outputs"]] == [0, 1] and out["text"] == out["outputs"][0]["text"]
    for completion in out["outputs"]:
        assert len(completion["logprobs"]) == len(completion["token_ids"]) == 5
        assert completion["finish_reason"] == "length" and completion["stop_reason"] is None
        assert all(token in dict(map(tuple, entry)) for token, entry in zip(completion["token_ids"],
                                                                             completion["logprobs"]))


def test_stream_prints_the_same_text_as_generate(tied_model, capsys):
    argv = ["generate", "--model", tied_model, "--quiet", "--max-tokens", "8", "--ignore-eos", "Hello", "tensor"]
    assert main(argv + ["--json"]) == 0
    texts = [o["text"] for o in _json_lines(capsys.readouterr().out)]
    assert main(argv + ["--stream"]) == 0
    streamed = capsys.readouterr().out
    assert streamed == "".join(f"Prompt: {p!r}\nOutput: {t}\n\n" for p, t in zip(["Hello", "tensor"], texts))


@pytest.mark.parametrize("argv, expected", [(("--device", "cpu"), 128), (("--device", "cpu", "--max-num-seqs", "512"), 512)])
def test_serve_on_the_cpu_runs_at_most_128_sequences_unless_told(monkeypatch, argv, expected):
    import tpengine.entrypoints.server as server
    seen = {}
    monkeypatch.setattr(server, "run_server", lambda **kwargs: seen.update(kwargs["engine_kwargs"]) or 0)
    assert main(["serve", "--model", "unused", *argv]) == 0
    assert seen["max_num_seqs"] == expected


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_kv_cache_dtype_flag_takes_vllms_names_and_refuses_others(command, capsys):
    parser = build_parser()
    assert parser.parse_args([command]).kv_cache_dtype == "auto"
    assert parser.parse_args([command, "--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
    assert parser.parse_args([command, "--kv-cache-dtype", "fp8_e4m3"]).kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args([command, "--kv-cache-dtype", "fp16"])
    assert exit_info.value.code == 2 and re.search(r"choose from '?auto'?, '?fp8'?, '?fp8_e4m3'?",
                                                              capsys.readouterr().err)


def test_serve_passes_kv_cache_dtype_to_the_engine(monkeypatch):
    import tpengine.entrypoints.server as server
    seen = {}
    monkeypatch.setattr(server, "run_server", lambda **kwargs: seen.update(kwargs["engine_kwargs"]) or 0)
    assert main(["serve", "--model", "unused", "--kv-cache-dtype", "fp8"]) == 0
    assert seen["kv_cache_dtype"] == "fp8"


# Every EngineConfig field, none at its default, and the flags users type for them: a new field is added to both.
EVERY_SETTING = dict(
    model="/m", tokenizer="/t", dtype="bfloat16", max_model_len=128, seed=5, runner="pooling",
    hf_overrides={"num_labels": 1}, limit_mm_per_prompt={"image": 2}, allowed_local_media_path="/media",
    reasoning_parser="qwen3", device="cpu",
    attention_backend="torch", enforce_eager=True, batch_invariant=True, mla_prefill="expanded",
    warm_up=True, tensor_parallel_size=2, pipeline_parallel_size=2,
    pp_layer_partition=[3, 1], max_steps_in_flight=1, step_timeout_s=10.0, kvcache_block_size=32, kv_cache_dtype="fp8",
    num_kvcache_blocks=7, kvcache_memory_gb=1.5, gpu_memory_utilization=0.5, enable_prefix_caching=False,
    max_num_seqs=3, max_num_batched_tokens=64, scheduling_policy="prefill_first", quantization="int4",
    quantization_group_size=32, quantize_lm_head=False, gguf_activations="float",
    speculative_config={"method": "ngram", "num_speculative_tokens": 2}, enable_lora=True, max_loras=3,
    max_lora_rank=32, max_cpu_loras=4)
EVERY_FLAG = [
    "--model", "/m", "--tokenizer", "/t", "--dtype", "bfloat16", "--max-model-len", "128", "--engine-seed", "5", "--runner", "pooling",
    "--hf-overrides", '{"num_labels": 1}', "--limit-mm-per-prompt", '{"image": 2}', "--allowed-local-media-path",
    "/media", "--reasoning-parser", "qwen3",
    "--device", "cpu", "--attention-backend", "torch", "--enforce-eager", "--batch-invariant",
    "--mla-prefill", "expanded", "--warm-up", "--tp", "2", "--pp", "2",
    "--pp-layer-partition", "3,1", "--max-steps-in-flight", "1", "--step-timeout-s", "10", "--block-size", "32",
    "--kv-cache-dtype", "fp8", "--num-kvcache-blocks", "7", "--kvcache-memory-gb", "1.5", "--gpu-memory-utilization",
    "0.5", "--no-enable-prefix-caching", "--max-num-seqs", "3", "--max-num-batched-tokens", "64",
    "--scheduling-policy", "prefill_first", "--quantization", "int4", "--quantization-group-size", "32",
    "--no-quantize-lm-head", "--gguf-activations", "float", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
    "--enable-lora", "--max-loras", "3", "--max-lora-rank", "32", "--max-cpu-loras", "4"]


def test_every_setting_is_listed_here_away_from_its_default():
    assert list(EVERY_SETTING) == list(engine_fields())
    assert [name for name, field in engine_fields().items() if EVERY_SETTING[name] == field.default] == []


@pytest.mark.parametrize("under_torchrun", [False, True])
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_every_engine_setting_is_a_flag_of_both_commands_and_in_their_help(command, under_torchrun, capsys):
    with pytest.raises(SystemExit):
        build_parser(under_torchrun=under_torchrun).parse_args([command, "--help"])
    help_text = capsys.readouterr().out
    missing = [field.flag for field in engine_fields().values() if not re.search(rf"{field.flag}\b", help_text)]
    assert missing == []
    for group in SETTING_GROUPS:
        assert f"engine {group} settings:" in help_text


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_the_flags_give_the_config_the_keyword_arguments_give(command):
    args = build_parser().parse_args([command, *EVERY_FLAG])
    assert EngineConfig(model=args.model, **_engine_kwargs(args)) == EngineConfig(**EVERY_SETTING)
    # and no flag at all gives the engine's defaults (serve's --max-num-seqs aside, off the CPU here), but for
    # serve's warm-up before /health
    args = build_parser().parse_args([command, "--model", "/m", "--device", "cuda"])
    assert EngineConfig(model=args.model, **_engine_kwargs(args)) == EngineConfig(
        model="/m", device="cuda", warm_up=command == "serve")


def test_serve_passes_the_settings_it_could_not_reach_before_to_the_engine(monkeypatch):
    import tpengine.entrypoints.server as server
    seen = {}
    monkeypatch.setattr(server, "run_server", lambda **kwargs: seen.update(kwargs["engine_kwargs"]) or 0)
    assert main(["serve", "--model", "unused", "--gpu-memory-utilization", "0.5", "--no-enable-prefix-caching",
                 "--kvcache-memory-gb", "0.25", "--max-steps-in-flight", "1", "--step-timeout-s", "30"]) == 0
    assert {name: seen[name] for name in ("gpu_memory_utilization", "enable_prefix_caching", "kvcache_memory_gb",
                                          "max_steps_in_flight", "step_timeout_s")} == dict(
        gpu_memory_utilization=0.5, enable_prefix_caching=False, kvcache_memory_gb=0.25, max_steps_in_flight=1,
        step_timeout_s=30.0)


def test_serve_without_prefix_caching_computes_a_repeated_prompt_again(tied_model):
    from tests.entrypoints.conftest import Server
    server = Server("--model", tied_model, "--block-size", "16", "--no-enable-prefix-caching")
    try:
        body = {"model": Server.model_name, "prompt": "the same prompt, long enough for two blocks", "max_tokens": 1}
        usages = [server.request("POST", "/v1/completions", body)[1]["usage"] for _ in range(2)]
        assert [usage["prompt_tokens_details"]["cached_tokens"] for usage in usages] == [0, 0]
        assert server.stop() == 0
    finally:
        server.kill_leftovers()


def test_the_checked_in_flag_reference_is_current():
    with open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "docs", "cli.md")) as f:
        assert f.read() == flag_reference(), "run: python tools/write_cli_reference.py"
