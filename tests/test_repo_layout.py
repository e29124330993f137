"""The checkout's root is on sys.path whenever Python runs there (`python -m pytest`, `python -c`, a REPL), so
nothing at the root may be importable under the name of an installed package: transformers imports Hugging
Face's `kernels`, and a kernels/__init__.py here would answer in its place."""
import importlib.metadata
import subprocess
import sys
from importlib.machinery import all_suffixes
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


def importable_top_level_names(root: Path) -> set[str]:
    """The names `import NAME` finds as a module or a regular package in root (a folder without __init__.py is a
    namespace portion: an installed package of its name is found before it)."""
    names = set()
    for entry in root.iterdir():
        if entry.is_dir() and (entry / "__init__.py").is_file():
            names.add(entry.name)
        elif entry.is_file():
            suffix = next((s for s in all_suffixes() if entry.name.endswith(s)), None)
            if suffix is not None:
                names.add(entry.name[:-len(suffix)].split(".")[0])
    return names


def shadowed_names(root: Path) -> dict[str, list[str]]:
    """Each name importable from root that an installed distribution other than tpengine also puts at the top level,
    with those distributions."""
    installed = importlib.metadata.packages_distributions()
    shadowed = {}
    for name in sorted(importable_top_level_names(root)):
        others = sorted(set(installed.get(name, ())) - {"tpengine"})
        if others:
            shadowed[name] = others
    return shadowed


def test_nothing_at_the_repo_root_shadows_an_installed_package():
    assert shadowed_names(REPO_ROOT) == {}


def test_a_kernels_package_at_the_root_would_be_caught(tmp_path):
    # the layout this test guards against: kernels/__init__.py at the root, with Hugging Face's kernels installed
    if "kernels" not in importlib.metadata.packages_distributions():
        pytest.skip("Hugging Face's kernels package is not installed")
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    assert shadowed_names(tmp_path) == {"kernels": ["kernels"]}


def test_python_run_in_the_checkout_imports_the_installed_kernels_and_ours_as_tpengine_kernels():
    if "kernels" not in importlib.metadata.packages_distributions():
        pytest.skip("Hugging Face's kernels package is not installed")
    script = ("import importlib.metadata, kernels, tpengine.kernels.cpu.build as ours\n"
              "from transformers import Qwen3ForCausalLM\n"
              "print(kernels.__file__, importlib.metadata.distribution('kernels').locate_file('kernels/__init__.py'))\n"
              "print(ours.__file__)")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    imported, installed, ours = result.stdout.split()
    assert Path(imported).resolve() == Path(installed).resolve()
    assert Path(ours).resolve() == REPO_ROOT / "kernels" / "cpu" / "build.py"
