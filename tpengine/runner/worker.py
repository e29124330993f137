"""A worker rank's life: join the group, load its shard, then run every step rank 0 sends until told to stop."""
import base64
import os
import signal
import sys
import threading
import traceback

if __name__ == "__main__":  # spawned by rank 0: ignore Ctrl-C before the slow imports below (rank 0 stops every rank)
    signal.signal(signal.SIGINT, signal.SIG_IGN)

import torch.distributed as dist

from tpengine.config import EngineConfig
from tpengine.distributed.broadcast_channel import BroadcastChannel
from tpengine.distributed.messages import InitMessage, ShutdownMessage, decode_control, encode_error
from tpengine.distributed.parallel_state import (PipelineGroup, TensorParallelGroup, connect_store, local_device_index,
                                                 new_process_group, resolve_device, torchrun_groups)
from tpengine.distributed.shm.ring import ShmRingReader
from tpengine.long_lived import freeze_start_up_objects
from tpengine.runner.model_runner import ModelRunner


def serve(config: EngineConfig, group: TensorParallelGroup, device, channel,
          pipeline: PipelineGroup | None = None) -> None:
    """Execute steps from channel (a ring reader or broadcast channel) until a ShutdownMessage."""
    runner = ModelRunner(config, group, device, pipeline=pipeline)
    freeze_start_up_objects()  # a full collection's pause on one rank would stall every rank's step
    try:
        while True:
            message = decode_control(channel.read())
            if isinstance(message, ShutdownMessage):
                return
            runner.execute(message)
    finally:
        runner.pipeline.finish_sends()  # the next stage may still be reading the last hidden states
        runner.close()


def _exit_with_rank0() -> None:
    """Die as soon as rank 0's process ends, whichever thread started us and however it ends.

    Rank 0 holds the only write end of this process's stdin and never writes: the kernel closes
    it when rank 0's process is gone, and the read below returns EOF.
    """
    def watch() -> None:
        while os.read(0, 4096):
            pass
        os._exit(1)

    threading.Thread(target=watch, name="tpengine-rank0-watch", daemon=True).start()


def spawned_worker_main(rank: int, world_size: int, store_port: int, init_bytes: bytes) -> None:
    """Entry point of a worker process that LLM(tensor_parallel_size=N) started."""
    _exit_with_rank0()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which stops every rank
    init = decode_control(init_bytes)
    assert isinstance(init, InitMessage)
    ring = None if init.ring_name is None else ShmRingReader(init.ring_name, rank - 1)
    try:
        store = connect_store(store_port)
        store.set(f"attached/{rank}", "1")  # rank 0 waits for every rank's mark before it unlinks the ring
        config = init.config
        device = resolve_device(config.device, local_device_index(rank, launched_by_torchrun=False))
        tp = config.tensor_parallel_size
        group = TensorParallelGroup.create(store, rank % tp, tp, device, stage=rank // tp)
        pipeline = PipelineGroup.create(store, rank, tp, config.pipeline_parallel_size, config.pipeline_layers(),
                                        device)
        channel = ring or BroadcastChannel(new_process_group(dist.PrefixStore("control", store), rank, world_size,
                                                             device, "gloo"), src=0)
        serve(config, group, device, channel, pipeline)
        group.shutdown()
        pipeline.shutdown()
    except BaseException:
        if ring is not None:
            try:
                ring.post_error(encode_error(rank, traceback.format_exc(), ring.error_capacity))
            except BaseException:
                pass  # rank 0 still sees this rank exit with code 1
        else:
            traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # skip atexit and group teardown: peers must see this rank go, not wait on it
    if ring is not None:
        ring.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # nothing left to tear down that another rank waits on


def torchrun_worker_main() -> None:
    """Entry point of ranks > 0 under torchrun: rank 0 sends the config, then the steps."""
    rank = dist.get_rank()
    control = BroadcastChannel(dist.new_group(backend="gloo"))
    init = decode_control(control.read())
    assert isinstance(init, InitMessage)
    channel = control if init.ring_name is None else ShmRingReader(init.ring_name, rank - 1)
    try:
        device = resolve_device(init.config.device, local_device_index(rank, launched_by_torchrun=True))
        group, pipeline = torchrun_groups(init.config.tensor_parallel_size, init.config.pipeline_layers(), device)
        serve(init.config, group, device, channel, pipeline)
    except BaseException:
        if isinstance(channel, ShmRingReader):
            channel.post_error(encode_error(rank, traceback.format_exc(), channel.error_capacity))
        raise
    finally:
        if isinstance(channel, ShmRingReader):
            channel.close()


if __name__ == "__main__":
    rank, world_size, store_port, init = sys.argv[1:]
    spawned_worker_main(int(rank), int(world_size), int(store_port), base64.b64decode(init))
