"""Every Triton kernel compiles for sm_90 and sm_80 on this GPU-less machine and fits the target's shared memory
(tools/compile_triton_kernels.py), and a @triton.jit function that no COMPILE_CASES entry compiles fails."""
import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest

from tests.tools import TOOLS, import_tool

KERNELS = {"_store_kvcache_kernel", "_paged_decode_kernel", "_paged_prefill_kernel", "_grouped_gemm_kernel",
           "_block_fp8_matmul_kernel", "_quant_matmul_kernel", "_lora_add_kernel", "_latent_decode_kernel",
           "_join_splits_kernel"}
KERNEL_MODULE = '''
import triton
import triton.language as tl


@triton.jit
def _double(x):
    return x * 2


@triton.jit
def _kernel(out, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out + offs, _double(offs))


@triton.jit
def _other_kernel(out, N: tl.constexpr):
    tl.store(out + tl.arange(0, N), 0)
'''
CASE = 'dict(kernel=_kernel, signature={sig}, constexprs={{"N": 16}}, num_warps=4, num_stages=3, name="n 16")'
FULL_SIGNATURE = '{"out": "*i32", "N": "constexpr"}'
SIGNATURE_WITHOUT_N = '{"out": "*i32"}'


@pytest.fixture(scope="module")
def aot():
    return import_tool("compile_triton_kernels")


def test_every_kernel_compiles_for_sm_90_and_sm_80_within_shared_memory(background_compile):
    returncode, stdout, stderr = background_compile.result(timeout=280)  # started when this test was collected
    print(stdout)  # the table, shown with pytest -s
    assert os.path.exists(background_compile.json), stderr[-3000:]
    with open(background_compile.json) as f:
        record = json.load(f)
    assert record["problems"] == []
    assert returncode == 0, stderr[-3000:]
    results = record["results"]
    assert KERNELS <= {r["kernel"] for r in results}
    for case in {(r["module"], r["case"]) for r in results}:
        assert sorted(r["target"] for r in results if (r["module"], r["case"]) == case) == ["sm_80", "sm_90"]
    # Spills cost speed, not correctness, and only a GPU can say how much: reported, not failed.
    spills = [f"{r['module']} {r['case']!r} on {r['target']}: {r['spill_store_bytes']} B" for r in results
              if r["spill_store_bytes"]]
    if spills:
        warnings.warn(f"{len(spills)} compiled kernels spill registers (spill stores a thread): " + "; ".join(spills))


def test_the_project_kernels_are_each_compiled_by_a_case(aot):
    assert aot.coverage_problems(aot.kernel_modules()) == []


def fake_kernel_package(aot, tmp_path, monkeypatch, modules: dict) -> list:
    """The modules of a package made of {module name: source}, imported from tmp_path."""
    package = f"fake_kernels_{tmp_path.name}"
    os.makedirs(tmp_path / package)
    (tmp_path / package / "__init__.py").write_text("")
    for name, source in modules.items():
        (tmp_path / package / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    return aot.kernel_modules(package)


def test_a_module_with_kernels_and_no_compile_cases_fails(aot, tmp_path, monkeypatch):
    modules = fake_kernel_package(aot, tmp_path, monkeypatch, {"new": KERNEL_MODULE})
    [problem] = aot.coverage_problems(modules)
    assert "no COMPILE_CASES" in problem and "_kernel" in problem and "_other_kernel" in problem


def test_a_kernel_in_no_case_fails_and_a_helper_its_caller_compiles_passes(aot, tmp_path, monkeypatch):
    source = KERNEL_MODULE + f"\nCOMPILE_CASES = [{CASE.format(sig=FULL_SIGNATURE)}]\n"
    modules = fake_kernel_package(aot, tmp_path, monkeypatch, {"new": source})
    [problem] = aot.coverage_problems(modules)
    assert "['_other_kernel'] compiled by no COMPILE_CASES entry" in problem


def test_a_kernel_that_does_not_compile_is_reported_with_the_compiler_error(tmp_path):
    # the error the attention kernels had: a global float read in jit code runs in the interpreter only
    cases = f"COMPILE_CASES = [{CASE.format(sig=FULL_SIGNATURE)}]"
    source = KERNEL_MODULE.replace("x * 2", "x * SCALE") + f"\nSCALE = 2.0\n{cases}\n"
    (tmp_path / "uncompilable.py").write_text(textwrap.dedent(source))
    code = ("import dataclasses, json, sys; import compile_triton_kernels as aot; "
            "print(json.dumps(dataclasses.asdict(aot.compile_case('uncompilable', 0, aot.TARGETS[0]))))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([TOOLS, str(tmp_path)])
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    compiled = json.loads(result.stdout.splitlines()[-1])
    assert compiled["shared_bytes"] is None and "Cannot access global variable SCALE" in compiled["error"]


def test_a_case_whose_signature_misses_an_argument_fails(aot, tmp_path, monkeypatch):
    source = KERNEL_MODULE + f"\nCOMPILE_CASES = [{CASE.format(sig=SIGNATURE_WITHOUT_N)}]\n"
    modules = fake_kernel_package(aot, tmp_path, monkeypatch, {"new": source})
    problems = aot.coverage_problems(modules)
    assert any("must list the kernel's arguments ['out', 'N']" in p for p in problems)


def test_a_case_is_not_compiled_for_a_target_below_its_min_capability(aot, tmp_path, monkeypatch):
    case = CASE.format(sig=FULL_SIGNATURE).replace('name="n 16"', 'name="n 16", min_capability=89')
    [module] = fake_kernel_package(aot, tmp_path, monkeypatch, {"new": KERNEL_MODULE + f"\nCOMPILE_CASES = [{case}]\n"})
    sm_90, sm_80 = aot.TARGETS
    result = aot.compile_case(module.__name__, 0, sm_80)
    assert result.not_for_target == "not for sm_80: min_capability 89" and result.fits and result.shared_bytes is None


def test_a_helper_handed_to_a_kernel_as_a_constexpr_counts_as_compiled(aot, tmp_path, monkeypatch):
    source = KERNEL_MODULE.replace("_double(offs)", "FN(offs)").replace("(out, N", "(out, FN: tl.constexpr, N")
    case = CASE.format(sig='{"out": "*i32", "FN": "constexpr", "N": "constexpr"}')
    case = case.replace('{"N": 16}', '{"FN": _double, "N": 16}')
    modules = fake_kernel_package(aot, tmp_path, monkeypatch, {"new": source + f"\nCOMPILE_CASES = [{case}]\n"})
    [problem] = aot.coverage_problems(modules)
    assert "['_other_kernel'] compiled by no COMPILE_CASES entry" in problem
