"""BroadcastChannel across real gloo ranks started with torch.multiprocessing.spawn."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.distributed.channels import payload
from tpengine.distributed.broadcast_channel import BroadcastChannel
from tpengine.distributed.parallel_state import find_free_port

SIZES = [0, 1, 300, 10_000, 65_537, 3_000_000]
RANKS_TIMEOUT_S = 60


def _exchange(rank: int, world_size: int, port: int, src: int) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=RANKS_TIMEOUT_S),
    )
    try:
        channel = BroadcastChannel(src=src)
        for index, size in enumerate(SIZES):
            if rank == src:
                channel.write(payload(index, size))
            else:
                received = channel.read()
                assert received == payload(index, size), f"rank {rank}: message {index} differs"
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("world_size", "src"), [(2, 0), (3, 1)])
def test_messages_of_several_sizes_arrive_intact_in_order(world_size, src):
    ranks = mp.spawn(_exchange, args=(world_size, find_free_port(), src), nprocs=world_size, join=False)
    try:
        deadline = time.monotonic() + RANKS_TIMEOUT_S
        while not ranks.join(timeout=0.5):  # raises if a rank failed
            assert time.monotonic() < deadline, "ranks did not finish"
    finally:
        for process in ranks.processes:
            if process.is_alive():
                process.kill()
            process.join()
