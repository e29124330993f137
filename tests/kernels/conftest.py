"""Shared setup for the kernel tests; the reference attention is tests/reference_attention.py.

The Triton kernels run compiled on a GPU, and without one in the interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before anything imports triton); their tests build every tensor on DEVICE.
"""
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

from tests.conftest import relative_error
from tests.tools import TOOLS
from tests.reference_attention import paged_attention as reference_paged_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype):
    """NaN-poisoned K/V caches holding random keys/values for each sequence in scattered physical blocks.

    Returns (k_cache, v_cache, block_tables); unused table entries are -1 and every slot
    not owned by a token is NaN, so reading either makes the kernel output fail.
    """
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2  # spare blocks no sequence owns
    physical = torch.randperm(num_blocks).tolist()
    block_tables = torch.full((len(seq_lens), max(max(blocks_per_seq), 1)), -1, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    for b, n in enumerate(seq_lens):
        for i in range(blocks_per_seq[b]):
            block_tables[b, i] = physical.pop()
        pos = torch.arange(n)
        blocks = block_tables[b, pos // block_size].long()
        k_cache[blocks, pos % block_size] = torch.randn(n, num_kv_heads, head_dim, dtype=dtype)
        v_cache[blocks, pos % block_size] = torch.randn(n, num_kv_heads, head_dim, dtype=dtype)
    return k_cache, v_cache, block_tables


def forget_blocks_before_window(k_cache, v_cache, block_tables, context_lens, window):
    """What the ledger does to blocks no query can see again: they go back to the pool (here: NaN, and -1 in
    the table), so a kernel that read one would fail."""
    block_size = k_cache.size(1)
    for b, n in enumerate(context_lens):
        for i in range(max(0, n - window) // block_size):
            k_cache[block_tables[b, i]] = v_cache[block_tables[b, i]] = float("nan")
            block_tables[b, i] = -1


def check_paged_decode(kernel, block_size, head_dim, num_heads, num_kv_heads, context_lens, dtype, tol, *,
                       window=None, softcap=None, sinks=False):
    """kernel(q, k_cache, v_cache, block_tables, context_lens, scale, window=, softcap=, sinks=), the contract
    both decode kernels share, against the reference, row by row; q is a strided view, like the query part of
    a fused QKV. With a window, the blocks before it are NaN and -1 in the table."""
    k_cache, v_cache, block_tables = random_paged_kv(context_lens, block_size, num_kv_heads, head_dim, dtype)
    if window is not None:
        forget_blocks_before_window(k_cache, v_cache, block_tables, context_lens, window)
    q = torch.randn(len(context_lens), num_heads + 2, head_dim, dtype=dtype)[:, :num_heads]
    scale = head_dim**-0.5
    sink_logits = torch.randn(num_heads) * 2 if sinks else None
    out = kernel(q, k_cache, v_cache, block_tables, torch.tensor(context_lens, dtype=torch.int32), scale,
                 window=window or 0, softcap=softcap or 0.0, sinks=sink_logits)
    assert out.dtype == dtype and out.shape == q.shape and not out.isnan().any()
    for b, n in enumerate(context_lens):
        table = block_tables[b].clamp(min=0)  # the reference gathers every block, masked ones too
        ref = reference_paged_attention(q[b : b + 1], k_cache.nan_to_num(), v_cache.nan_to_num(), table, n, scale,
                                        window=window, softcap=softcap, sinks=sink_logits)
        assert relative_error(out[b : b + 1], ref) < tol


def check_empty_context_row(kernel):
    """A padded batch slot (context length 0) gives zeros, not NaN, and leaves its neighbour alone."""
    k_cache, v_cache, block_tables = random_paged_kv([20, 0], 16, 1, 64, torch.float32)
    q = torch.randn(2, 1, 64)
    out = kernel(q, k_cache, v_cache, block_tables, torch.tensor([20, 0], dtype=torch.int32), 0.125)
    assert not out[0].isnan().any() and torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.fixture
def triton_device():
    """Tensors the test creates land on DEVICE: the GPU the compiled kernels need, if there is one."""
    with torch.device(DEVICE):
        yield


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _poison_empty(monkeypatch):
    """Kernels allocate outputs with torch.empty or torch.empty_like: NaN-fill them so any element left
    unwritten fails."""
    for name in ("empty", "empty_like"):
        monkeypatch.setattr(torch, name, _nan_filled(getattr(torch, name)))


def _nan_filled(allocate):
    def poisoned(*args, **kwargs):
        out = allocate(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out
    return poisoned


# Helpers are handed out as fixtures: test modules cannot import conftest reliably.
@pytest.fixture
def rel_err():
    return relative_error


@pytest.fixture
def paged_kv():
    return random_paged_kv


@pytest.fixture
def ref_attention():
    return reference_paged_attention


@pytest.fixture
def check_decode():
    return check_paged_decode


@pytest.fixture
def check_empty_context():
    return check_empty_context_row


# --- the ahead-of-time compile, started early -------------------------------------------------------

COMPILE_TEST = "test_every_kernel_compiles_for_sm_90_and_sm_80_within_shared_memory"


class BackgroundCompile:
    """tools/compile_triton_kernels.py running at the lowest CPU priority from the moment its test is collected:
    ptxas then takes the cores the other tests leave idle (servers starting, deadlines waited out) rather than ~50 s
    of its own. The test waits for it and checks what it wrote."""

    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix="tpengine-compile-")
        self.json = os.path.join(self.folder, "compiled.json")
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled: the interpreter cannot be
        self.stdout = open(os.path.join(self.folder, "stdout"), "w+")
        self.stderr = open(os.path.join(self.folder, "stderr"), "w+")
        self.process = subprocess.Popen([sys.executable, os.path.join(TOOLS, "compile_triton_kernels.py"), "--json",
                                         self.json], env=env, stdout=self.stdout, stderr=self.stderr,
                                        preexec_fn=lambda: os.nice(19))

    def result(self, timeout: float) -> tuple[int, str, str]:
        """(exit status, stdout, stderr) once the compile has ended."""
        returncode = self.process.wait(timeout=timeout)
        self.stdout.seek(0)
        self.stderr.seek(0)
        return returncode, self.stdout.read(), self.stderr.read()

    def close(self) -> None:
        if self.process.poll() is None:  # its test was not run (deselected, or the run stopped first)
            self.process.kill()
            self.process.wait()
        self.stdout.close()
        self.stderr.close()
        shutil.rmtree(self.folder, ignore_errors=True)


_background_compile: BackgroundCompile | None = None


def pytest_collection_finish(session):
    global _background_compile
    if _background_compile is None and any(item.name == COMPILE_TEST for item in session.items):
        _background_compile = BackgroundCompile()


def pytest_sessionfinish(session):
    if _background_compile is not None:
        _background_compile.close()


@pytest.fixture
def background_compile() -> BackgroundCompile:
    return _background_compile or BackgroundCompile()  # collected some other way: started now
