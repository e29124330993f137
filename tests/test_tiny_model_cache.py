"""write_tiny_model's cache: a checkpoint written once per set of arguments, copied from tpengine's cache folder
after (byte for byte what transformers writes, without importing it, torch's random state left as the writing leaves
it); a broken entry is written again, not used."""
import json
import os
import subprocess
import sys

import pytest
import torch

from tpengine import tiny_model
from tpengine.tiny_model import write_tiny_model

# one layer of 32: a few hundred kilobytes, written in a fraction of a second once transformers is imported
SMALL = dict(seed=7, num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
             num_key_value_heads=1, head_dim=16)


def read_folder(path) -> dict[str, bytes]:
    return {name: open(os.path.join(path, name), "rb").read() for name in sorted(os.listdir(path))}


@pytest.fixture
def cache(tmp_path, monkeypatch) -> str:
    """An empty cache folder of the test's own, the cache on."""
    monkeypatch.setenv("TPENGINE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TPENGINE_TINY_MODEL_CACHE", raising=False)
    return str(tmp_path / "cache" / tiny_model.CACHE_FOLDER)


@pytest.fixture
def fresh(tmp_path_factory, monkeypatch) -> dict[str, bytes]:
    """SMALL as transformers writes it, the cache off."""
    path = str(tmp_path_factory.mktemp("fresh") / "model")
    with monkeypatch.context() as m:
        m.setenv("TPENGINE_TINY_MODEL_CACHE", "0")
        write_tiny_model(path, **SMALL)
    return read_folder(path)


def next_draws_after_a_fresh_write(monkeypatch, tmp_path) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setenv("TPENGINE_TINY_MODEL_CACHE", "0")
        write_tiny_model(str(tmp_path / "rng"), **SMALL)
    return torch.rand(8)


def entries(cache: str) -> list[str]:
    return sorted(os.listdir(cache)) if os.path.isdir(cache) else []


def test_the_copy_is_a_fresh_write_byte_for_byte_and_needs_no_transformers(cache, fresh, tmp_path):
    write_tiny_model(str(tmp_path / "first"), **SMALL)  # written, and kept
    [entry] = entries(cache)
    assert read_folder(tmp_path / "first") == fresh
    # another process copies it without importing transformers
    code = ("import sys; from tpengine.tiny_model import write_tiny_model; "
            f"write_tiny_model(sys.argv[1], **{SMALL!r}); "
            "assert 'transformers' not in sys.modules, 'imported'")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path / "second")], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_folder(tmp_path / "second") == fresh and entries(cache) == [entry]
    # copies, not links: rewriting one in place leaves the cache as it was
    weights = tmp_path / "second" / "model.safetensors"
    assert os.stat(weights).st_nlink == 1
    assert not os.path.samefile(weights, os.path.join(cache, entry, "model.safetensors"))
    weights.write_bytes(b"rewritten")
    write_tiny_model(str(tmp_path / "third"), **SMALL)
    assert read_folder(tmp_path / "third") == fresh


def test_a_copy_leaves_torchs_random_state_as_a_write_does(cache, tmp_path, monkeypatch):
    expected = next_draws_after_a_fresh_write(monkeypatch, tmp_path)
    write_tiny_model(str(tmp_path / "first"), **SMALL)  # written and kept
    assert torch.equal(torch.rand(8), expected)
    torch.manual_seed(1234)
    write_tiny_model(str(tmp_path / "second"), **SMALL)  # copied
    assert torch.equal(torch.rand(8), expected)


def test_every_argument_and_version_changes_the_key(monkeypatch):
    base = dict(seed=0, with_tokenizer=True, architecture="Qwen3ForCausalLM", bos_token=None)
    key = tiny_model.cache_key(**base)
    assert key == tiny_model.cache_key(**base) and key.startswith("Qwen3ForCausalLM-")
    keys = {key}
    for change in (dict(seed=1), dict(with_tokenizer=False), dict(architecture="LlamaForCausalLM"),
                   dict(bos_token="<|begin_of_text|>"), dict(num_hidden_layers=2), dict(num_hidden_layers=3),
                   dict(rope_scaling={"rope_type": "linear", "factor": 2.0})):
        keys.add(tiny_model.cache_key(**{**base, **change}))
    with monkeypatch.context() as m:
        m.setattr(tiny_model, "TINY_MODEL_VERSION", "next")
        keys.add(tiny_model.cache_key(**base))
    with monkeypatch.context() as m:
        m.setattr(tiny_model, "_source_digest", lambda: "edited")
        keys.add(tiny_model.cache_key(**base))
    versions = tiny_model._package_versions()
    for package in ("transformers", "torch", "tokenizers", "safetensors"):
        with monkeypatch.context() as m:
            m.setattr(tiny_model, "_package_versions", lambda: {**versions, package: "0.0.1"})
            keys.add(tiny_model.cache_key(**base))
    assert len(keys) == 14 and None not in keys
    # no key, so no cache: turned off, or an override JSON cannot hold
    monkeypatch.setenv("TPENGINE_TINY_MODEL_CACHE", "0")
    assert tiny_model.cache_key(**base) is None
    monkeypatch.delenv("TPENGINE_TINY_MODEL_CACHE")
    assert tiny_model.cache_key(**base, torch_dtype=object()) is None


def corrupt_weights(entry):
    with open(os.path.join(entry, "model.safetensors"), "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\0\1\2\3")


def truncate_tokenizer(entry):
    with open(os.path.join(entry, "tokenizer.json"), "r+b") as f:
        f.truncate(100)


def remove_manifest(entry):
    os.remove(os.path.join(entry, tiny_model.MANIFEST))


def remove_a_file(entry):
    os.remove(os.path.join(entry, "config.json"))


def garble_manifest(entry):
    with open(os.path.join(entry, tiny_model.MANIFEST), "w") as f:
        f.write('{"files": {"config.json": ')


def garble_rng_state(entry):
    with open(os.path.join(entry, tiny_model.MANIFEST)) as f:
        manifest = json.load(f)
    with open(os.path.join(entry, tiny_model.MANIFEST), "w") as f:
        json.dump({**manifest, "rng_state": "not hex"}, f)


@pytest.mark.parametrize("damage", [corrupt_weights, truncate_tokenizer, remove_manifest, remove_a_file,
                                    garble_manifest, garble_rng_state])
def test_a_broken_entry_is_not_used_but_written_again(cache, fresh, tmp_path, damage):
    write_tiny_model(str(tmp_path / "first"), **SMALL)
    [entry] = entries(cache)
    damage(os.path.join(cache, entry))
    write_tiny_model(str(tmp_path / "second"), **SMALL)
    assert read_folder(tmp_path / "second") == fresh
    assert entries(cache) == [entry]  # written again, whole
    manifest = json.loads(open(os.path.join(cache, entry, tiny_model.MANIFEST)).read())
    assert sorted(manifest["files"]) == sorted(fresh)
    assert tiny_model._read_cache_entry(os.path.join(cache, entry))[0] == fresh


def test_a_second_writer_finding_the_entry_kept_leaves_it_and_no_staging(cache, fresh, tmp_path, monkeypatch):
    write_tiny_model(str(tmp_path / "first"), **SMALL)
    [entry] = entries(cache)
    monkeypatch.setattr(tiny_model, "_read_cache_entry", lambda entry: (None, None))  # as if it raced the first
    write_tiny_model(str(tmp_path / "second"), **SMALL)
    assert read_folder(tmp_path / "second") == fresh and entries(cache) == [entry]
    monkeypatch.undo()
    assert tiny_model._read_cache_entry(os.path.join(cache, entry))[0] == fresh


def test_a_model_over_the_size_limit_is_written_but_not_kept(cache, fresh, tmp_path, monkeypatch):
    monkeypatch.setattr(tiny_model, "CACHE_MAX_BYTES", 1000)
    write_tiny_model(str(tmp_path / "model"), **SMALL)
    assert read_folder(tmp_path / "model") == fresh and entries(cache) == []


def test_an_unwritable_cache_folder_writes_as_without_one(fresh, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TPENGINE_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.delenv("TPENGINE_TINY_MODEL_CACHE", raising=False)
    write_tiny_model(str(tmp_path / "model"), **SMALL)
    assert read_folder(tmp_path / "model") == fresh


def test_a_bad_setting_still_raises_and_keeps_nothing(cache, tmp_path):
    with pytest.raises(ValueError, match="smaller than the byte tokenizer"):
        write_tiny_model(str(tmp_path / "model"), **{**SMALL, "vocab_size": 100})
    assert entries(cache) == []
