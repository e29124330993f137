"""Every Triton kernel in tpengine.kernels.triton compiled ahead of time for sm_90 (H100/H200) and sm_80 (A100) on
a machine without a GPU: each case's shared memory against its target's limit, and the registers and spills ptxas
reports for it.

    python tools/compile_triton_kernels.py [--jobs N] [--json PATH]

Prints one table row per (case, target); exits 1 when a case does not compile or needs more shared memory than
its target has, or when a @triton.jit function is compiled by no case. tests/kernels/test_triton_compile.py runs it.

A kernel module lists what to compile in a module-level COMPILE_CASES, each entry
    {"kernel": the @triton.jit function,
     "signature": {argument: "*bf16", "*fp8e4nv", "*i32", "i32", "fp32", ... or "constexpr"}, every argument in order,
     "constexprs": {argument: value}, "num_warps": int, "num_stages": int, "name": a short description,
     optionally "min_capability": int, below which it is not compiled (89 for fp8e4nv: Triton refuses it for sm_80)}
built by the function that picks the launcher's constexprs, so the cases compile what runs. A helper (a jit function
only other jit functions call) needs no case: it is compiled inside the kernels that call it.

Registers and spills come from ptxas' own log of each compile, so every run compiles afresh (into a temporary Triton
cache). Integer arguments get none of the divisibility hints the runtime adds to multiples of 16, so loads may
vectorize less than on a GPU and registers differ a little from the launched kernel.
"""
import argparse
import ast
import concurrent.futures
import contextlib
import dataclasses
import importlib
import inspect
import io
import multiprocessing
import os
import pkgutil
import re
import resource
import sys
import tempfile
import textwrap
import time
import warnings

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction, KernelInterface

from tpengine.bench.results import Record, add_json_flag

KERNEL_PACKAGE = "tpengine.kernels.triton"
CASE_KEYS = {"kernel", "signature", "constexprs", "num_warps", "num_stages", "name"}
OPTIONAL_CASE_KEYS = {"min_capability"}  # e.g. 89 for fp8e4nv, which Triton cannot compile for sm_80


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    capability: int
    # The opt-in shared memory per block that Triton's launcher checks (CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_
    # BLOCK_OPTIN): 227 KiB on compute capability 9.0, 163 KiB on 8.0 (CUDA Programming Guide, compute capabilities)
    max_shared_bytes: int


TARGETS = (Target("sm_90", 90, 227 * 1024), Target("sm_80", 80, 163 * 1024))


@dataclasses.dataclass(frozen=True)
class CaseResult:
    module: str
    case: str
    kernel: str
    target: str
    max_shared_bytes: int
    seconds: float
    cpu_seconds: float  # this process's and ptxas', so roughly the same on a loaded machine
    shared_bytes: int | None = None  # None: it did not compile (error says why)
    registers: int | None = None
    spill_store_bytes: int | None = None
    spill_load_bytes: int | None = None
    error: str | None = None
    not_for_target: str | None = None  # why the case was not compiled for this target (its min_capability)

    @property
    def fits(self) -> bool:
        return self.not_for_target is not None or (self.error is None and self.shared_bytes <= self.max_shared_bytes)


def python_function(jit_fn):
    """The Python function under a @triton.jit function (also under autotune or heuristics, or the interpreter's)."""
    while not inspect.isfunction(jit_fn):
        jit_fn = jit_fn.fn
    return jit_fn


def is_jit_function(obj) -> bool:
    return isinstance(obj, KernelInterface)  # also the interpreter's functions and autotune's wrappers


def kernel_modules(package: str = KERNEL_PACKAGE) -> list:
    """Every module of the package, those of its subpackages too."""
    root = importlib.import_module(package)
    return [importlib.import_module(info.name) for info in pkgutil.walk_packages(root.__path__, f"{package}.")]


def jit_functions_defined_in(module) -> dict:
    """{name: Python function} of the @triton.jit functions the module defines (not those it imports)."""
    return {name: python_function(obj) for name, obj in vars(module).items()
            if is_jit_function(obj) and python_function(obj).__module__ == module.__name__}


def called_jit_functions(fn) -> set:
    """The Python functions of the @triton.jit functions fn calls by name or module attribute."""
    called = set()
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(fn)))):
        if not isinstance(node, ast.Call):
            continue
        path, target = [], node.func
        while isinstance(target, ast.Attribute):
            path.append(target.attr)
            target = target.value
        if not isinstance(target, ast.Name) or target.id not in fn.__globals__:
            continue
        obj = fn.__globals__[target.id]
        for attr in reversed(path):
            obj = getattr(obj, attr, None)
        if is_jit_function(obj):
            called.add(python_function(obj))
    return called


def case_problems(module, case) -> list[str]:
    """What makes one COMPILE_CASES entry unusable, each naming the entry; empty when it can be compiled."""
    where = f"{module.__name__}: COMPILE_CASES entry {case.get('name', '?')!r}"
    if not isinstance(case, dict) or not CASE_KEYS <= set(case) <= CASE_KEYS | OPTIONAL_CASE_KEYS:
        return [f"{where} must be a dict with the keys {sorted(CASE_KEYS)}, optionally {sorted(OPTIONAL_CASE_KEYS)}"]
    if not is_jit_function(case["kernel"]):
        return [f"{where}: its kernel is not a @triton.jit function"]
    arguments = list(inspect.signature(python_function(case["kernel"])).parameters)
    problems = []
    if list(case["signature"]) != arguments:
        problems.append(f"{where}: its signature must list the kernel's arguments {arguments} in order, "
                        f"got {list(case['signature'])}")
    marked = [name for name, kind in case["signature"].items() if kind == "constexpr"]
    if sorted(marked) != sorted(case["constexprs"]):
        problems.append(f"{where}: the arguments marked constexpr {marked} must be the constexprs' keys "
                        f"{list(case['constexprs'])}")
    warps = case["num_warps"]
    if not (isinstance(warps, int) and warps > 0 and not warps & (warps - 1)):
        problems.append(f"{where}: num_warps must be a power of two, got {case['num_warps']!r}")
    if not (isinstance(case["num_stages"], int) and case["num_stages"] >= 1):
        problems.append(f"{where}: num_stages must be an int >= 1, got {case['num_stages']!r}")
    return problems


def coverage_problems(modules: list) -> list[str]:
    """Why the modules' COMPILE_CASES miss something: an unusable entry, or a @triton.jit function that no case
    compiles (not a case's kernel, nor called from one), so no new kernel can skip the compile check."""
    problems, reached = [], set()
    for module in modules:
        for case in getattr(module, "COMPILE_CASES", []):
            found = case_problems(module, case)
            problems += found
            if not found:  # its kernel, and any jit function handed to it as a constexpr
                reached |= {python_function(fn) for fn in [case["kernel"], *case["constexprs"].values()]
                            if is_jit_function(fn)}
    pending = list(reached)
    while pending:
        for fn in called_jit_functions(pending.pop()) - reached:
            reached.add(fn)
            pending.append(fn)
    for module in modules:
        missed = [name for name, fn in jit_functions_defined_in(module).items() if fn not in reached]
        if missed and not hasattr(module, "COMPILE_CASES"):
            problems.append(f"{module.__name__}: defines the @triton.jit functions {missed} but no COMPILE_CASES")
        elif missed:
            problems.append(f"{module.__name__}: {missed} compiled by no COMPILE_CASES entry (none is its kernel "
                            "or calls it)")
    return problems


def compile_case(module_name: str, index: int, target: Target) -> CaseResult:
    """COMPILE_CASES[index] of the module compiled for the target; a compile error is returned, not raised.
    Sets Triton's knobs for this process: every compile runs ptxas, which prints its report."""
    case = importlib.import_module(module_name).COMPILE_CASES[index]
    fields = dict(module=module_name.rsplit(".", 1)[-1], case=case["name"],
                  kernel=python_function(case["kernel"]).__name__, target=target.name,
                  max_shared_bytes=target.max_shared_bytes)
    start, cpu_start = time.perf_counter(), _cpu_seconds()
    if case.get("min_capability", 0) > target.capability:  # its callers never launch it there
        return CaseResult(**fields, seconds=0.0, cpu_seconds=0.0,
                          not_for_target=f"not for {target.name}: min_capability {case['min_capability']}")
    triton.knobs.compilation.always_compile = True  # a cached kernel would skip ptxas and its report
    triton.knobs.nvidia.dump_ptxas_log = True
    kernel = case["kernel"]
    while not isinstance(kernel, JITFunction):  # under autotune or heuristics
        kernel = kernel.fn
    source = ASTSource(kernel, case["signature"], case["constexprs"])
    options = {"num_warps": case["num_warps"], "num_stages": case["num_stages"]}
    ptxas_log = io.StringIO()
    try:
        with contextlib.redirect_stdout(ptxas_log):  # where the backend prints ptxas -v's report
            compiled = triton.compile(source, target=GPUTarget("cuda", target.capability, 32), options=options)
    except Exception as e:  # any compiler failure is the finding: report it with the case
        return CaseResult(**fields, seconds=time.perf_counter() - start, cpu_seconds=_cpu_seconds() - cpu_start,
                          error=_compile_error(e))
    log = ptxas_log.getvalue()
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert registers and spills, f"ptxas -v printed no register or spill report:\n{log}"
    return CaseResult(**fields, seconds=time.perf_counter() - start, cpu_seconds=_cpu_seconds() - cpu_start,
                      shared_bytes=compiled.metadata.shared,
                      registers=int(registers[1]), spill_store_bytes=int(spills[1]), spill_load_bytes=int(spills[2]))


def _compile_error(e: Exception) -> str:
    """One line: where the compile failed (a CompilationError starts "at line:column:") and the root cause."""
    cause = e
    while (cause.__cause__ or cause.__context__) is not None:  # a jit helper's error is chained in its caller's
        cause = cause.__cause__ or cause.__context__
    where = str(e).strip().split("\n", 1)[0] if cause is not e else ""
    return f"{where} {type(cause).__name__}: {str(cause).strip()}".strip().replace("\n", " ")[:400]


def _cpu_seconds() -> float:
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def _start_worker(cache_dir: str) -> None:
    triton.knobs.cache.dir = cache_dir  # a temporary cache: the compiles leave no cubins in the user's
    # Triton 3.9 warns that its default will change; the launchers leave it unset too (fusion on), as these compiles do
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")


def compile_all(modules: list, jobs: int, targets=TARGETS) -> list[CaseResult]:
    """The modules' usable COMPILE_CASES entries for every target, in jobs forked processes (they inherit the
    imported modules); results in case order, each case's targets together."""
    tasks = [(module.__name__, index, target) for module in modules
             for index, case in enumerate(getattr(module, "COMPILE_CASES", [])) if not case_problems(module, case)
             for target in targets]
    with tempfile.TemporaryDirectory(prefix="triton_aot_") as cache_dir:
        if jobs == 1:
            _start_worker(cache_dir)
            return [compile_case(*task) for task in tasks]
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork"),
                                                    initializer=_start_worker, initargs=(cache_dir,)) as pool:
            return list(pool.map(compile_case, *zip(*tasks)))


def _kib(n: int) -> str:
    return f"{n / 1024:.1f}"


def table(results: list[CaseResult]) -> str:
    lines = ["| module | case | target | shared KiB (limit) | registers | spill stores / loads B | compile s (CPU s) |",
             "|---|---|---|---:|---:|---:|---:|"]
    for r in results:
        seconds = f"{r.seconds:.1f} ({r.cpu_seconds:.1f})"
        if r.error is not None or r.not_for_target is not None:
            why = r.not_for_target or f"did not compile: {r.error}"
            lines.append(f"| {r.module} | {r.case} | {r.target} | {why} | | | {seconds} |")
            continue
        shared = f"{_kib(r.shared_bytes)} ({_kib(r.max_shared_bytes)})" + ("" if r.fits else " **over**")
        lines.append(f"| {r.module} | {r.case} | {r.target} | {shared} | {r.registers} "
                     f"| {r.spill_store_bytes} / {r.spill_load_bytes} | {seconds} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="cases compiled at once, one process each "
                        "(default: one per CPU)")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    if triton.knobs.runtime.interpret:  # the interpreter's jit functions cannot be compiled
        parser.error("unset TRITON_INTERPRET: the kernels are compiled here, not interpreted")
    record = Record("compile_triton_kernels", argv)
    modules = kernel_modules()
    problems = coverage_problems(modules)
    results = compile_all(modules, args.jobs)
    print(table(results))
    problems += [f"{r.module}: {r.case!r} for {r.target}: "
                 + (f"did not compile: {r.error}" if r.error is not None
                    else f"needs {r.shared_bytes} bytes of shared memory, over the {r.max_shared_bytes} it has")
                 for r in results if not r.fits]
    for problem in problems:
        print(problem, file=sys.stderr)
    record.write(args.json, results=[dataclasses.asdict(r) for r in results], problems=problems)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
