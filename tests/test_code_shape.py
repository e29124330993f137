"""A function a reader takes in at once: none in tpengine/ (kernels aside: their launch tables and C++ builders
read top to bottom) runs over MAX_FUNCTION_LINES lines, so a change finds its room instead of growing one."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "tpengine"
MAX_FUNCTION_LINES = 60


def long_functions(root: Path, limit: int) -> list[str]:
    """'path:line name (n lines)' for every function or method under root longer than limit, kernels/ skipped."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if "kernels" in path.relative_to(root).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_function_in_the_package_runs_over_60_lines():
    assert long_functions(PACKAGE, MAX_FUNCTION_LINES) == []


def test_the_check_finds_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "long.py").write_text(f"def too_long():\n{body}\n")
    (tmp_path / "short.py").write_text("def short():\n    return 1\n")
    assert long_functions(tmp_path, MAX_FUNCTION_LINES) == [f"{tmp_path.name}/long.py:1 too_long (61 lines)"]
