"""Packed weights in memory advised for huge pages: equal copies, contiguous, kept alive by the tensor alone, and
(where the kernel's transparent huge pages are "always" or "madvise") a mapping the kernel may back with 2 MB pages."""
import gc
import mmap
import os

import pytest
import torch

from tpengine.kernels.cpu.huge_pages import HUGE_PAGE, empty_on_huge_pages, on_huge_pages


def thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


def mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds address."""
    fields, inside = {}, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(bound, 16) for bound in head.split("-"))
                inside = start <= address < end
            elif inside:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    return fields


def test_a_large_tensor_is_copied_exactly_and_outlives_every_other_reference():
    t = torch.randn(3, HUGE_PAGE // 4)  # 3 huge pages of float32
    copy = on_huge_pages(t.t())  # a strided view: the copy is contiguous, in t's logical order
    del t
    gc.collect()
    assert copy.is_contiguous() and copy.shape == (HUGE_PAGE // 4, 3)
    reference = copy.clone()
    copy.mul_(2)  # the memory is the tensor's own: writable, and still mapped
    assert torch.equal(copy, reference * 2)


def test_small_tensors_and_other_layouts_are_left_as_they_are():
    small = torch.randn(100)
    assert on_huge_pages(small) is small
    assert empty_on_huge_pages((10,), torch.bfloat16).shape == (10,)


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE") or thp_mode() == "never",
                    reason="this kernel backs no memory with transparent huge pages")
def test_the_memory_is_eligible_for_huge_pages():
    t = empty_on_huge_pages((4 * HUGE_PAGE,), torch.uint8)
    t.fill_(1)
    assert mapping_of(t.data_ptr()).get("THPeligible") == "1"
    if thp_mode() == "madvise" and not os.environ.get("THP_MEM_ALLOC_ENABLE"):  # torch's own memory, for contrast
        assert mapping_of(torch.empty(4 * HUGE_PAGE, dtype=torch.uint8).data_ptr()).get("THPeligible") == "0"
