"""What imports what, each checked in a fresh interpreter: records know no machinery, rank 0's ledger and
the wire structs load neither torch nor transformers, and kernels know only tensors; and, read from the
source, layers and models reach the CPU's C++ ops only through the platform room."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

# settings, sampling params, outputs, errors and the checkpoint's config: records every layer may import
GROUND_FLOOR = ["tpengine.config", "tpengine.sampling_params", "tpengine.outputs", "tpengine.errors",
                "tpengine.hf_config", "tpengine.cache"]
MACHINERY = ["engine", "runner", "models", "layers", "platforms", "distributed", "attention", "entrypoints", "kernels"]
# rank 0's bookkeeping and what it sends the workers: they start before (or without) torch
LIGHT = [*GROUND_FLOOR, "tpengine.engine.llm_engine", "tpengine.engine.block_manager", "tpengine.engine.scheduler",
         "tpengine.engine.sequence", "tpengine.distributed.messages"]
KERNELS = ["tpengine.kernels.cpu.build", "tpengine.kernels.cpu.bf16_linear", "tpengine.kernels.cpu.fused_ops",
           "tpengine.kernels.cpu.paged_decode_attention", "tpengine.kernels.cpu.sampling",
           "tpengine.kernels.cpu.shm_allreduce", "tpengine.kernels.triton.fused_moe",
           "tpengine.kernels.triton.paged_decode_attention", "tpengine.kernels.triton.paged_prefill_attention",
           "tpengine.kernels.triton.quant_matmul", "tpengine.kernels.triton.store_kvcache"]


def loaded_after_importing(modules: list[str], before: str = "") -> list[str]:
    """The modules a fresh interpreter loads importing these, beyond what `before` loads."""
    script = (f"import importlib, sys\n{before}\nfirst = set(sys.modules)\n"
              f"for name in {modules!r}:\n    importlib.import_module(name)\n"
              "print('\\n'.join(sorted(set(sys.modules) - first)))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.split()


def test_the_ground_floor_imports_nothing_of_the_machinery():
    loaded = loaded_after_importing(GROUND_FLOOR)
    assert [m for m in loaded if m.split(".")[:2] in [["tpengine", layer] for layer in MACHINERY]] == []


def test_the_ledger_the_settings_and_the_wire_structs_load_neither_torch_nor_transformers():
    loaded = loaded_after_importing(LIGHT)
    assert [m for m in loaded if m.split(".")[0] in ("torch", "transformers")] == []


def test_kernels_import_nothing_of_the_package_but_the_cache_folder():
    pytest.importorskip("triton")
    # importing any of it runs tpengine/__init__.py, which loads only the ground floor (checked above)
    loaded = loaded_after_importing(KERNELS, before="import tpengine")
    assert [m for m in loaded if m.startswith("tpengine.") and not m.startswith("tpengine.kernels")
            and m != "tpengine.cache"] == []


def imported_modules(path: Path) -> set[str]:
    """Every module a source file imports, by its full name (from a import b: a.b and a)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_layers_and_models_reach_the_cpu_kernels_only_through_the_platforms():
    # a layer picks its platform's ops when it is built (tpengine/platforms); a model file reads like the architecture
    package = Path(__file__).resolve().parent.parent / "tpengine"
    sources = sorted([*(package / "layers").glob("*.py"), *(package / "models").glob("*.py")])
    assert sources
    offenders = {}
    for path in sources:
        kernels = sorted(name for name in imported_modules(path) if name.startswith("tpengine.kernels.cpu"))
        if kernels:
            offenders[str(path.relative_to(package))] = kernels
    assert offenders == {}
