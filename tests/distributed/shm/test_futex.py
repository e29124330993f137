"""Futex waits on a word of shared memory: a wake after a change ends the wait, a stale value does not
sleep, and a timeout ends it when nothing comes."""
import mmap
import threading

import pytest

from tpengine.distributed.shm import futex

pytestmark = pytest.mark.skipif(not futex.available(), reason="no futex syscall number for this platform")


def _waiter(address: int, seen: int, timeout_s: float) -> threading.Thread:
    thread = threading.Thread(target=futex.wait, args=(address, seen, timeout_s), daemon=True)
    thread.start()
    return thread


def test_a_wake_after_the_word_changes_ends_a_long_wait():
    shared = mmap.mmap(-1, 4096)
    words = memoryview(shared).cast("Q")
    address = futex.address_of(shared, 64)
    waiter = _waiter(address, 0, 600.0)
    waiter.join(0.2)
    assert waiter.is_alive()  # asleep: the word still holds what it saw
    words[8] = 1
    futex.wake(address)
    waiter.join(30.0)
    assert not waiter.is_alive()
    words.release()
    shared.close()  # address_of kept no export of the mapping


def test_a_wait_on_a_value_the_word_no_longer_holds_returns_at_once():
    shared = mmap.mmap(-1, 4096)
    memoryview(shared).cast("Q")[0] = 7
    waiter = _waiter(futex.address_of(shared), 6, 600.0)
    waiter.join(30.0)
    assert not waiter.is_alive()


def test_a_wait_nobody_wakes_ends_at_its_timeout():
    shared = mmap.mmap(-1, 4096)
    waiter = _waiter(futex.address_of(shared), 0, 0.05)
    waiter.join(30.0)
    assert not waiter.is_alive()
