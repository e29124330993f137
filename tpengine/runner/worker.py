"""A worker rank's life: join the group, load its shard, then run every step rank 0 sends until told to stop."""
import base64
import ctypes
import os
import signal
import sys
import traceback

import torch.distributed as dist

from tpengine.config import EngineConfig
from tpengine.distributed.broadcast_channel import BroadcastChannel
from tpengine.distributed.messages import (InitMessage, ShutdownMessage, WorkerError, decode_control, encode)
from tpengine.distributed.parallel_state import pick_backend
from tpengine.distributed.shm_ring import ShmRingReader
from tpengine.runner.model_runner import ModelRunner, resolve_device


def serve(config: EngineConfig, rank: int, channel) -> None:
    """Execute steps from channel (a ring reader or broadcast channel) until a ShutdownMessage."""
    runner = ModelRunner(config, rank)
    while True:
        message = decode_control(channel.read())
        if isinstance(message, ShutdownMessage):
            return
        runner.execute(message)


def _die_with_parent() -> None:
    # Linux: the kernel SIGKILLs this worker if rank 0 dies, however it dies.
    parent_pid = os.getppid()
    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if parent_pid == 1 or os.getppid() != parent_pid:  # rank 0 died before prctl took effect
        os._exit(1)


def spawned_worker_main(rank: int, world_size: int, init_method: str, init_bytes: bytes) -> None:
    """Entry point of a worker process that LLM(tensor_parallel_size=N) started."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which stops every rank
    init = decode_control(init_bytes)
    assert isinstance(init, InitMessage) and init.ring_name is not None
    ring = ShmRingReader(init.ring_name, rank - 1)
    try:
        device = resolve_device(init.config.device, rank)
        dist.init_process_group(pick_backend(device), init_method=init_method, rank=rank, world_size=world_size)
        serve(init.config, rank, ring)
    except BaseException:
        ring.post_error(encode(WorkerError(rank, traceback.format_exc())))
        ring.close()
        os._exit(1)  # skip atexit and group teardown: peers must see this rank go, not wait on it
    ring.close()
    dist.destroy_process_group()


def torchrun_worker_main() -> None:
    """Entry point of ranks > 0 under torchrun: rank 0 sends the config, then the steps."""
    rank = dist.get_rank()
    control = BroadcastChannel(dist.new_group(backend="gloo"))
    init = decode_control(control.read())
    assert isinstance(init, InitMessage)
    channel = control if init.ring_name is None else ShmRingReader(init.ring_name, rank - 1)
    try:
        serve(init.config, rank, channel)
    except BaseException:
        if isinstance(channel, ShmRingReader):
            channel.post_error(encode(WorkerError(rank, traceback.format_exc())))
        raise
    finally:
        if isinstance(channel, ShmRingReader):
            channel.close()


if __name__ == "__main__":
    rank, world_size, init_method, init = sys.argv[1:]
    spawned_worker_main(int(rank), int(world_size), init_method, base64.b64decode(init))
