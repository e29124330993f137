"""Tensors in memory backed by 2 MB pages (transparent huge pages) where the kernel allows it.

A decode step streams every weight once: with 4 KB pages that is a TLB miss and a page walk every 4 KB, and the
hardware prefetchers stop at each page's end. Linux backs anonymous private memory with 2 MB pages where it is
asked to (madvise MADV_HUGEPAGE: the setting most distributions ship is "madvise"). torch does so only when the
THP_MEM_ALLOC_ENABLE environment variable is set before it allocates anything, so the packed weights ask for it here.
"""
import math
import mmap

import torch

HUGE_PAGE = 2 << 20


def empty_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor in private anonymous memory advised for huge pages (untouched: its pages are
    allocated as they are first written), or torch.empty's where it is smaller than a huge page or the platform has
    no MADV_HUGEPAGE. The memory is unmapped when the last tensor viewing it is freed."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        memory.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel built without transparent huge pages: 4 KB pages, as torch's own memory
        pass
    return torch.frombuffer(memory, dtype=torch.uint8).view(dtype).view(shape)  # the tensor keeps `memory` alive


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a CPU tensor in memory advised for huge pages (empty_on_huge_pages); t itself (made
    contiguous) where that gives none, or where t is not a plain strided tensor (oneDNN's packed weights)."""
    if t.device.type != "cpu" or t.layout != torch.strided:
        return t
    t = t.contiguous()
    if t.numel() * t.element_size() < HUGE_PAGE:
        return t
    copy = empty_on_huge_pages(tuple(t.shape), t.dtype)
    copy.copy_(t)
    return copy
