"""Builds a C++ source of this folder into a library of torch ops on first use, and loads it.

A source is compiled once per machine with the system C++ compiler against the installed torch, into
tpengine's cache folder. Built for the host CPU (-march=native), so a build is keyed by the CPU's
feature flags as well as by the source, the torch version and the compiler.
"""
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile

import torch

FOLDER = os.path.dirname(os.path.abspath(__file__))
CXX_FLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++20", "-shared", "-fPIC", "-w"]


def compiler_name() -> str:
    """The C++ compiler builds use: $CXX, else c++."""
    return os.environ.get("CXX", "c++")


def has_compiler() -> bool:
    return shutil.which(compiler_name()) is not None


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (x86 "flags", aarch64 "Features"); empty without /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _cpu_features() -> str:
    return " ".join(sorted(cpu_flags())) or platform.processor()


def _compile_command(compiler: str, source: str, output: str, extra_flags: tuple[str, ...] = ()) -> list[str]:
    from torch.utils.cpp_extension import include_paths, library_paths

    libs = library_paths()
    return ([compiler, *CXX_FLAGS, *extra_flags, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
            + [f"-I{path}" for path in [FOLDER, *include_paths()]] + [source, "-o", output]
            # torch's own libgomp shares the soname libgomp.so.1: the ops run on torch's OpenMP pool
            + [f"-L{path}" for path in libs] + [f"-Wl,-rpath,{path}" for path in libs]
            + ["-lc10", "-ltorch_cpu", "-ltorch"])


def _build(compiler: str, source: str, folder: str, library: str, extra_flags: tuple[str, ...]) -> None:
    fd, staging = tempfile.mkstemp(suffix=".so", dir=folder)  # built aside, then renamed into place
    os.close(fd)
    try:
        result = subprocess.run(_compile_command(compiler, source, staging, extra_flags), capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"building {source} failed:\n{result.stderr[-4000:]}")
        os.replace(staging, library)
    finally:
        if os.path.exists(staging):
            os.unlink(staging)


def build_and_load(source_name: str, extra_flags: tuple[str, ...] = ()) -> None:
    """Build kernels/cpu/<source_name> if this machine has no build of it yet, then load its ops into
    torch.ops; RuntimeError saying why not (no compiler, a failed build). extra_flags follow CXX_FLAGS
    on this source's command line (and key its build)."""
    from tpengine.cache import cache_dir

    compiler = compiler_name()
    if not has_compiler():
        raise RuntimeError(f"no C++ compiler {compiler!r} on PATH (set CXX, or install g++)")
    source = os.path.join(FOLDER, source_name)
    with open(source, "rb") as f:
        text = f.read()
    for header in sorted(name for name in os.listdir(FOLDER) if name.endswith(".h")):  # what a source may include
        with open(os.path.join(FOLDER, header), "rb") as f:
            text += f.read()
    key = hashlib.sha256(b"\0".join([text, torch.__version__.encode(), compiler.encode(),
                                     " ".join(CXX_FLAGS + list(extra_flags)).encode(), _cpu_features().encode()])).hexdigest()[:16]
    folder = cache_dir("kernels")
    library = os.path.join(folder, f"cpu_{os.path.splitext(source_name)[0]}-{key}.so")
    if not os.path.exists(library):
        os.makedirs(folder, exist_ok=True)
        # one build per machine: ranks starting together wait for the first one's build
        with open(library + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not os.path.exists(library):
                _build(compiler, source, folder, library, extra_flags)
    torch.ops.load_library(library)


def build_and_load_or_warn(source_name: str, instead: str, extra_flags: tuple[str, ...] = ()) -> bool:
    """build_and_load(); False where it fails (no compiler, a failed build, an unwritable cache folder), with a
    warning that says what runs instead."""
    try:
        build_and_load(source_name, extra_flags)
    except (RuntimeError, OSError) as error:
        logging.getLogger("tpengine").warning("could not build %s (%s): %s", source_name, error, instead)
        return False
    return True
