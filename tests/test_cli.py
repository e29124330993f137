"""The `tpengine` command: generate (args, stdin, --json, --tp) and make-tiny-model."""
import hashlib
import json
import os
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from tests.conftest import hf_greedy
from tpengine.cli import main


def _json_lines(text):
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_help_documents_every_generate_flag(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = capsys.readouterr().out
    for flag in ("--model", "--tp", "--max-tokens", "--temperature", "--json", "--file", "--block-size",
                 "--attention-backend", "--enforce-eager", "--device", "--dtype"):
        assert flag in help_text


def test_generate_json_matches_transformers(tied_model, capsys):
    assert main(["generate", "--model", tied_model, "--max-tokens", "6", "--ignore-eos", "--json", "--quiet",
                 "--block-size", "16", "Hello", "tensor parallel"]) == 0
    outputs = _json_lines(capsys.readouterr().out)
    assert [o["prompt"] for o in outputs] == ["Hello", "tensor parallel"]
    expected = hf_greedy(tied_model, [o["prompt_token_ids"] for o in outputs], 6)
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


def test_make_tiny_model_is_deterministic(tmp_path, capsys):
    digests = []
    for name in ("a", "b"):
        assert main(["make-tiny-model", str(tmp_path / name)]) == 0
        with open(tmp_path / name / "model.safetensors", "rb") as f:
            digests.append(hashlib.sha256(f.read()).hexdigest())
    assert digests[0] == digests[1]
    assert os.path.exists(tmp_path / "a" / "tokenizer.json")


def test_default_model_from_stdin_at_tp_2_says_it_is_the_tiny_model(tmp_path):
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
