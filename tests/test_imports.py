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


PACKAGE = Path(__file__).resolve().parent.parent / "tpengine"


def module_files(package: Path) -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own name: its __init__.py)."""
    modules = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def import_graph(package: Path) -> dict[str, set[str]]:
    """Each module of the package -> the package's modules it imports, imports inside functions included (deferring
    an import hides a circle, it does not break it). `from a import b` names a.b where that is a module, else a;
    the package imports absolutely, so relative imports are not followed."""
    modules = module_files(package)
    graph = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.update(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules
                                else node.module for alias in node.names)
        graph[name] = {module for module in imported if module in modules and module != name}
    return graph


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """The modules start imports, and those they import, and so on (start itself only around a circle)."""
    seen, todo = set(), [start]
    while todo:
        for module in graph[todo.pop()]:
            if module not in seen:
                seen.add(module)
                todo.append(module)
    return seen


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each group of modules that import one another, directly or around a circle, sorted."""
    reach = {name: reachable(graph, name) for name in graph}
    groups = {tuple(sorted(other for other in reach[name] if name in reach[other]))
              for name in graph if name in reach[name]}
    return sorted(list(group) for group in groups)


def test_no_modules_of_the_package_import_one_another_in_a_circle():
    assert import_circles(import_graph(PACKAGE)) == []


def test_a_circle_closed_by_an_import_inside_a_function_is_found(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.b import build\nfrom pkg import c\n")
    (package / "b.py").write_text("def build():\n    from pkg import a\n    return a\n")
    (package / "c.py").write_text("import json\n")
    assert import_circles(import_graph(package)) == [["pkg.a", "pkg.b"]]
