"""What each rank process of tests/distributed/shm/test_all_reduce.py runs: kept light (torch and the
all-reduce only), since every test starts several of these processes."""
import functools
import os

import torch
import torch.distributed as dist

SMALL_SLOT_BYTES = 256  # 64 float32 elements: sizes up to 1000 elements go through in many pieces
SIZES = [1, 2, 63, 64, 65, 127, 128, 129, 1000]
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("tpengine_")}


def rank_input(rank: int, numel: int, dtype: torch.dtype, call: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * call + 7 * rank + numel)
    # values of mixed magnitudes, so that rounding after each addition shows in the low bits
    return (torch.randn(numel, generator=g) * 10.0 ** torch.randint(-2, 3, (numel,), generator=g)).to(dtype)


def assert_rank_order_sum(shm, numel: int, dtype: torch.dtype, call: int) -> torch.Tensor:
    inputs = [rank_input(r, numel, dtype, call) for r in range(shm.world_size)]
    result = inputs[shm.rank].clone()
    shm.all_reduce(result)
    expected = functools.reduce(torch.add, inputs)  # t_0 + t_1 + ... in dtype, as torch rounds it
    assert torch.equal(result.view(INT_VIEW[dtype]), expected.view(INT_VIEW[dtype])), (numel, dtype)
    return result


def check_sums(rank: int, world_size: int, port: int, names_file: str) -> None:
    from tpengine.distributed.shm.all_reduce import DEFAULT_SLOT_BYTES, connect

    torch.set_num_threads(1)  # up to 4 ranks on 2 cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    small, line = connect(rank, world_size, dist.all_reduce, slot_bytes=SMALL_SLOT_BYTES)
    assert small is not None and line == f"all-reduce: shared memory ({world_size} ranks on one host)", line
    dist.barrier()  # rank 0 has left connect(): the name is gone, every rank's mapping stays
    assert small.name not in segments()
    call = 0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for numel in SIZES:
            result = assert_rank_order_sum(small, numel, dtype, call)
            rank0 = result.clone()
            dist.broadcast(rank0, src=0)
            assert torch.equal(result.view(INT_VIEW[dtype]), rank0.view(INT_VIEW[dtype]))  # same bits everywhere
            call += 1
    # another segment of the default size beside the first, calls interleaved: each keeps its own count
    large, _ = connect(rank, world_size, dist.all_reduce)
    assert large.name != small.name
    if rank == 0:
        with open(names_file, "w") as f:
            f.write(f"{small.name}\n{large.name}\n")
    for numel in (DEFAULT_SLOT_BYTES // 4 - 1, DEFAULT_SLOT_BYTES // 4 * 2 + 5):
        assert_rank_order_sum(large, numel, torch.float32, call)
        assert_rank_order_sum(small, 300, torch.bfloat16, call + 1)
        call += 2
    # a non-contiguous tensor is reduced and written back in place
    inputs = [rank_input(r, 96, torch.float32, call).view(8, 12) for r in range(world_size)]
    transposed = inputs[rank].clone().t()
    small.all_reduce(transposed)
    assert torch.equal(transposed, functools.reduce(torch.add, inputs).t())
    if world_size >= 3:  # the check above can fail: one rounding at the end gives other bits than rank order
        inputs = [rank_input(r, 1000, torch.bfloat16, call) for r in range(world_size)]
        rounded_once = torch.stack([t.float() for t in inputs]).sum(0).bfloat16()
        assert not torch.equal(rounded_once, functools.reduce(torch.add, inputs))
    small.close()
    large.close()
    dist.destroy_process_group()


def check_gathers(rank: int, world_size: int, port: int) -> None:
    """gather_to_first gives rank 0 every rank's tensor bit for bit (-0.0 and NaN too), at sizes around
    the slot size, interleaved with all-reduces on the same segment, equal to gloo's gather."""
    from tpengine.distributed.shm.all_reduce import DEFAULT_SLOT_BYTES, connect

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    small, _ = connect(rank, world_size, dist.all_reduce, slot_bytes=SMALL_SLOT_BYTES)
    large, _ = connect(rank, world_size, dist.all_reduce)
    cases = [(small, numel, dtype) for dtype in (torch.float32, torch.bfloat16, torch.float16)
             for numel in [0] + SIZES]
    cases += [(large, numel, torch.float32) for numel in
              (DEFAULT_SLOT_BYTES // 4 - 1, DEFAULT_SLOT_BYTES // 4, DEFAULT_SLOT_BYTES // 4 + 1,
               DEFAULT_SLOT_BYTES // 4 * 2 + 5)]
    for call, (shm, numel, dtype) in enumerate(cases):
        inputs = [rank_input(r, numel, dtype, call) for r in range(world_size)]
        for t in inputs:
            if numel >= 3:
                t[0], t[1], t[2] = -0.0, float("nan"), float("-inf")
        mine = inputs[rank].clone()
        gathered = shm.gather_to_first(mine)
        assert torch.equal(mine.view(INT_VIEW[dtype]), inputs[rank].view(INT_VIEW[dtype]))  # left alone
        by_gloo = [torch.empty_like(mine) for _ in range(world_size)] if rank == 0 else None
        dist.gather(mine, by_gloo, dst=0)
        if rank == 0:
            assert gathered.shape == (world_size * numel,) and gathered.dtype == dtype
            bits = gathered.view(INT_VIEW[dtype])
            assert torch.equal(bits, torch.cat(inputs).view(INT_VIEW[dtype])), numel
            assert torch.equal(bits, torch.cat(by_gloo).view(INT_VIEW[dtype]))
        else:
            assert gathered is None
        if call % 3 == 0:  # the all-reduce and the gather share the slots and the sequence
            assert_rank_order_sum(shm, 300, torch.float32, call)
    # 2-D, as the LM head's logits: each rank's rows side by side, rows split across chunks; a
    # non-contiguous one too
    for rows, columns in ((8, 12), (37, SMALL_SLOT_BYTES // 4 // 3 + 1), (3, 2 * SMALL_SLOT_BYTES // 4 + 5)):
        inputs = [rank_input(r, rows * columns, torch.float32, 98).view(rows, columns) for r in range(world_size)]
        gathered = small.gather_to_first(inputs[rank])
        if rank == 0:
            assert torch.equal(gathered, torch.cat(inputs, dim=-1))
    inputs = [rank_input(r, 96, torch.float32, 99).view(8, 12) for r in range(world_size)]
    gathered = small.gather_to_first(inputs[rank].t())
    if rank == 0:
        assert torch.equal(gathered, torch.cat([t.t() for t in inputs], dim=-1))
    small.close()
    large.close()
    dist.destroy_process_group()


def check_wakes(rank: int, world_size: int, port: int, late_s: float) -> None:
    """With no spinning and a futex wait longer than the test allows, every all-reduce and gather
    whose last rank arrives late_s after the others still completes, bit for bit: the waiting ranks
    were asleep and the last rank's publish woke them. Each rank in turn is the late one."""
    import time

    from tpengine.distributed.shm import all_reduce as shm_all_reduce
    from tpengine.distributed.shm.all_reduce import connect

    torch.set_num_threads(1)
    shm_all_reduce._WAIT_SLICE_S = 600.0  # a lost wake-up would hang past the test's limit
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    shm, _ = connect(rank, world_size, dist.all_reduce, slot_bytes=SMALL_SLOT_BYTES)
    shm.spin_s = 0.0  # every waiting rank goes straight to sleep
    for call in range(world_size):
        late = call % world_size
        if rank == late:
            time.sleep(late_s)
        assert_rank_order_sum(shm, 100, torch.float32, call)  # two chunks: a wait on each
        if rank == late:
            time.sleep(late_s)
        inputs = [rank_input(r, 100, torch.float32, call) for r in range(world_size)]
        gathered = shm.gather_to_first(inputs[rank])
        if rank == 0:
            assert torch.equal(gathered, torch.cat(inputs))
    dist.barrier()
    assert shm._words[shm_all_reduce.SLEEPERS_WORD] == 0  # no rank is still counted as asleep
    shm.close()
    dist.destroy_process_group()
