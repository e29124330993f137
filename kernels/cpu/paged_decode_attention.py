"""The C++ paged decode attention for the CPU (paged_decode_attention.cpp), built on first use.

It is compiled once per machine with the system C++ compiler against the installed torch, into
tpengine's cache folder, and loaded as the torch op `torch.ops.tpengine_cpu.paged_decode_attention`.
Built for the host CPU (-march=native), so the build is keyed by the CPU's feature flags as well as
by the source, the torch version and the compiler.
"""
import fcntl
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile

import torch

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "paged_decode_attention.cpp")
CXX_FLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++20", "-shared", "-fPIC", "-w"]


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), platform.processor())
    except OSError:
        return platform.processor()


def _compile_command(compiler: str, output: str) -> list[str]:
    from torch.utils.cpp_extension import include_paths, library_paths

    libs = library_paths()
    return ([compiler, *CXX_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
            + [f"-I{path}" for path in include_paths()] + [SOURCE, "-o", output]
            # torch's own libgomp shares the soname libgomp.so.1: the op runs on torch's OpenMP pool
            + [f"-L{path}" for path in libs] + [f"-Wl,-rpath,{path}" for path in libs]
            + ["-lc10", "-ltorch_cpu", "-ltorch"])


def compiler_name() -> str:
    """The C++ compiler builds use: $CXX, else c++."""
    return os.environ.get("CXX", "c++")


def has_compiler() -> bool:
    return shutil.which(compiler_name()) is not None


def _build(compiler: str, folder: str, library: str) -> None:
    fd, staging = tempfile.mkstemp(suffix=".so", dir=folder)  # built aside, then renamed into place
    os.close(fd)
    try:
        result = subprocess.run(_compile_command(compiler, staging), capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"building {SOURCE} failed:\n{result.stderr[-4000:]}")
        os.replace(staging, library)
    finally:
        if os.path.exists(staging):
            os.unlink(staging)


@functools.cache
def load() -> None:
    """Build the op if this machine has no build of it yet, then load it; RuntimeError saying why not."""
    from tpengine.cache import cache_dir

    compiler = compiler_name()
    if not has_compiler():
        raise RuntimeError(f"no C++ compiler {compiler!r} on PATH (set CXX, or install g++)")
    with open(SOURCE, "rb") as f:
        source = f.read()
    key = hashlib.sha256(b"\0".join([source, torch.__version__.encode(), compiler.encode(),
                                     " ".join(CXX_FLAGS).encode(), _cpu_features().encode()])).hexdigest()[:16]
    folder = cache_dir("kernels")
    library = os.path.join(folder, f"cpu_paged_decode_attention-{key}.so")
    if not os.path.exists(library):
        os.makedirs(folder, exist_ok=True)
        # one build per machine: ranks starting together wait for the first one's build
        with open(library + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not os.path.exists(library):
                _build(compiler, folder, library)
    torch.ops.load_library(library)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """out[b] = softmax(scale * q[b] K_b^T) V_b over the first context_lens[b] cached tokens of sequence b.

    q: [batch, num_heads, head_dim] (head_dim contiguous); caches: [num_blocks, block_size, num_kv_heads,
    head_dim]; block_tables: [batch, max_num_blocks] int32; context_lens: [batch] int32, where 0 marks a
    padding row (its output is 0). The same contract as the Triton kernel of the same name.
    """
    load()
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    torch.ops.tpengine_cpu.paged_decode_attention(out, q, k_cache, v_cache, block_tables, context_lens, scale)
    return out
