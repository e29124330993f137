"""Each engine's tensor-parallel group, the collectives layers call through it, and which device a rank uses.

A group belongs to one engine, not to the process: spawned engines build theirs from their own
store and port, never `torch.distributed`'s global default group, so engines of any sizes live
side by side in one process. Layers read the group they are built under (`building_model_for`)
and call only the collectives below: this is the one seam a faster all-reduce plugs into.
"""
import logging
import os
import socket
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _get_current_dispatch_mode

logger = logging.getLogger("tpengine")

# Collectives wait this long for a peer before gloo/NCCL give up on their own; a dead or stuck
# rank is caught much sooner by the executor's watcher (runner/multiproc_executor.py).
GROUP_TIMEOUT = timedelta(minutes=30)

# Test mode (off by default): every rank on one GPU, gloo collectives on CUDA tensors, eager.
# It exercises the multi-rank CUDA path on a host with a single GPU, where NCCL cannot run two ranks.
ONE_GPU_TEST_MODE_ENV = "TPENGINE_TEST_ONE_GPU_TP"


def one_gpu_test_mode() -> bool:
    return os.environ.get(ONE_GPU_TEST_MODE_ENV) == "1"


def _all_reduce_min(process_group: dist.ProcessGroup, value: int, device: torch.device) -> int:
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MIN
    t = torch.tensor([value], dtype=torch.int64, device=device)
    process_group.allreduce([t], options).wait()
    return int(t.item())


class TensorParallelGroup:
    """This rank's place in its engine's group; size 1 needs no torch.distributed at all."""

    def __init__(self, rank: int = 0, size: int = 1, process_group: dist.ProcessGroup | None = None):
        assert size == 1 or process_group is not None, "a multi-rank group needs a process group"
        self.rank = rank
        self.size = size
        self.process_group = process_group
        self.shm_all_reduce = None  # a ShmAllReduce when every rank is a CPU process on one host

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum tensor over the ranks, in place: through shared memory where it can, else the process group."""
        if self.size == 1:
            return
        if torch._C._len_torch_dispatch_stack():
            # a forward being recorded (runner/cpu_replay.py): the recording keeps this call, whose Python (the
            # shared-memory sequence numbers, the waits on peers) must run again at every replay
            record = getattr(_get_current_dispatch_mode(), "record_host_call", None)
            if record is not None:
                record(self.all_reduce_now, tensor)
                return
        self.all_reduce_now(tensor)

    def all_reduce_now(self, tensor: torch.Tensor) -> None:
        if self.shm_all_reduce is not None and self.shm_all_reduce.supports(tensor):
            self.shm_all_reduce.all_reduce(tensor)
        else:
            self.process_group.allreduce([tensor]).wait()

    def use_shared_memory_if_one_host(self, device: torch.device) -> None:
        """CPU ranks: all-reduce through shared memory when every rank is on this host and has the C++
        kernel, else through gloo; rank 0 logs which. Collective; NCCL on GPUs is left alone."""
        if self.size == 1 or device.type != "cpu":
            return
        from tpengine.distributed.shm.all_reduce import connect
        self.shm_all_reduce, line = connect(self.rank, self.size, lambda t: self.process_group.allreduce([t]).wait())
        if self.rank == 0:
            logger.info(line)

    def all_reduce_min(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's value."""
        return value if self.size == 1 else _all_reduce_min(self.process_group, value, device)

    def gather_to_first(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Every rank's tensor concatenated along the last dimension in rank order, on rank 0; None on the
        other ranks: through the all-reduce's shared memory where it can, else the process group."""
        if self.size == 1:
            return tensor
        if self.shm_all_reduce is not None and self.shm_all_reduce.supports(tensor):
            return self.shm_all_reduce.gather_to_first(tensor)
        options = dist.GatherOptions()
        options.rootRank = 0
        gathered = [[torch.empty_like(tensor) for _ in range(self.size)]] if self.rank == 0 else []
        self.process_group.gather(gathered, [tensor], options).wait()
        return torch.cat(gathered[0], dim=-1) if self.rank == 0 else None

    def abort(self) -> None:
        """Make collectives blocked in another thread return with an error (a peer is gone)."""
        if self.shm_all_reduce is not None:
            self.shm_all_reduce.abort()
        if self.process_group is not None:
            self.process_group.abort()

    def shutdown(self) -> None:
        """Release the communicator between steps, every rank alike (what destroy_process_group does)."""
        if self.shm_all_reduce is not None:
            self.shm_all_reduce.close()
            self.shm_all_reduce = None
        if self.process_group is not None:
            self.process_group.shutdown()

    @classmethod
    def create(cls, store: dist.Store, rank: int, size: int, device: torch.device,
               stage: int = 0) -> "TensorParallelGroup":
        """This rank's group (of pipeline stage `stage`) of an engine whose store rank 0 serves; every rank
        calls it at start, rank being its place in its stage."""
        if device.type == "cuda":
            torch.cuda.set_device(device)  # before the communicator exists: NCCL binds to the current device
        prefix = "tp" if stage == 0 else f"tp{stage}"
        group = cls(rank, size, new_process_group(dist.PrefixStore(prefix, store), rank, size, device,
                                                  pick_backend(device)))
        group.use_shared_memory_if_one_host(device)
        return group


SINGLE_RANK = TensorParallelGroup()


@dataclass(frozen=True)
class PipelineStage:
    """Which slice of the layers this rank's model holds: [start_layer, end_layer); the first stage also
    holds the embedding, the last the final norm and LM head."""
    rank: int = 0
    size: int = 1
    start_layer: int = 0
    end_layer: int = 1 << 30

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def holds(self, layer_idx: int) -> bool:
        return self.start_layer <= layer_idx < self.end_layer


WHOLE_MODEL = PipelineStage()


class PipelineGroup:
    """This rank's pipeline stage and its point-to-point links: hidden states to the same tensor-parallel
    rank of the next stage, and the last stage's sampled tokens (or logits) to rank 0. Global rank =
    stage * tp + tensor-parallel rank. Sends do not block; a send's buffer is kept until it is done."""

    def __init__(self, stage: PipelineStage = WHOLE_MODEL, tp_size: int = 1, tp_rank: int = 0,
                 process_group: dist.ProcessGroup | None = None):
        assert stage.size == 1 or process_group is not None, "a pipeline needs a process group"
        self.stage = stage
        self.tp_size = tp_size
        self.rank = stage.rank * tp_size + tp_rank
        self.process_group = process_group
        self._sends: list[tuple] = []  # (work, tensor): in flight

    @property
    def size(self) -> int:
        return self.stage.size

    # tag: the step's virtual engine (gloo pairs a send with the receive of the same tag; NCCL has no tags)
    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        self._sends = [(work, t) for work, t in self._sends if not work.is_completed()]
        self._sends.append((self.process_group.send([tensor], dst, tag), tensor))

    def _recv(self, shape, dtype: torch.dtype, device: torch.device, src: int, tag: int) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype, device=device)
        self.process_group.recv([tensor], src, tag).wait()
        return tensor

    def send_to_next_stage(self, tensor: torch.Tensor, tag: int) -> None:
        self._send(tensor.contiguous(), self.rank + self.tp_size, tag)

    def recv_from_previous_stage(self, shape, dtype: torch.dtype, device: torch.device, tag: int) -> torch.Tensor:
        return self._recv(shape, dtype, device, self.rank - self.tp_size, tag)

    def send_to_first(self, tensor: torch.Tensor, tag: int) -> None:
        """The last stage's first rank hands rank 0 what it sampled."""
        self._send(tensor.contiguous(), 0, tag)

    def recv_from_last(self, shape, dtype: torch.dtype, device: torch.device, tag: int) -> torch.Tensor:
        return self._recv(shape, dtype, device, (self.size - 1) * self.tp_size, tag)

    def all_reduce_min(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's value, over every stage."""
        return value if self.size == 1 else _all_reduce_min(self.process_group, value, device)

    def finish_sends(self) -> None:
        for work, _ in self._sends:
            work.wait()
        self._sends = []

    def abort(self) -> None:
        if self.process_group is not None:
            self.process_group.abort()

    def shutdown(self) -> None:
        if self.process_group is not None:
            self.process_group.shutdown()

    @classmethod
    def create(cls, store: dist.Store, rank: int, tp_size: int, pp_size: int, layers: list[tuple[int, int]],
               device: torch.device) -> "PipelineGroup":
        """Global rank `rank`'s stage and links, over every rank of an engine whose store rank 0 serves."""
        stage_rank = rank // tp_size
        stage = PipelineStage(stage_rank, pp_size, *layers[stage_rank])
        if pp_size == 1:
            return cls(stage, tp_size, rank % tp_size)
        group = new_process_group(dist.PrefixStore("pp", store), rank, tp_size * pp_size, device, pick_backend(device))
        return cls(stage, tp_size, rank % tp_size, group)

_building = threading.local()


@contextmanager
def building_model_for(group: TensorParallelGroup, stage: PipelineStage = WHOLE_MODEL):
    """Layers constructed inside this block shard themselves for group, and a model holds only stage's layers
    (per thread, restored after)."""
    previous = getattr(_building, "group", None), getattr(_building, "stage", None)
    _building.group, _building.stage = group, stage
    try:
        yield
    finally:
        _building.group, _building.stage = previous


def get_tp_group() -> TensorParallelGroup:
    """The group of the model being built in this thread; a single rank outside building_model_for."""
    return getattr(_building, "group", None) or SINGLE_RANK


def get_pipeline_stage() -> PipelineStage:
    """The pipeline stage of the model being built in this thread; the whole model outside building_model_for."""
    return getattr(_building, "stage", None) or WHOLE_MODEL


def pick_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" and not one_gpu_test_mode() else "gloo"


def new_process_group(store: dist.Store, rank: int, size: int, device: torch.device,
                      backend: str) -> dist.ProcessGroup:
    """A process group of its own, outside torch.distributed's global state.

    Built as torch's own object-oriented API (torch.distributed._dist2) builds one; gloo serves
    CUDA tensors too, which the one-GPU test mode relies on.
    """
    group = dist.ProcessGroup(store, rank, size)
    if backend == "gloo":
        gloo = dist.ProcessGroupGloo(store, rank, size, GROUP_TIMEOUT)
        group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        for device_type in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
            group._register_backend(torch.device(device_type), dist.ProcessGroup.BackendType.GLOO, gloo)
        return group
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = GROUP_TIMEOUT
    nccl = dist.ProcessGroupNCCL(store, rank, size, options)
    nccl.eager_connect_single_device(device)  # binds the communicator to this rank's GPU, as device_id does
    group._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
    group._register_backend(device, dist.ProcessGroup.BackendType.NCCL, nccl)
    return group


def serve_store(timeout: timedelta) -> dist.TCPStore:
    """Rank 0's store for one engine, on a port the OS picks; workers connect with connect_store."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)


def connect_store(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=GROUP_TIMEOUT)


def torchrun_groups(tp_size: int, layers: list[tuple[int, int]],
                    device: torch.device) -> tuple[TensorParallelGroup, "PipelineGroup"]:
    """Under torchrun: this rank's tensor-parallel group (the launch script's global group, without pipeline
    parallelism; else its stage's ranks) and its pipeline links (over the global group). Collective."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    pp_size = world_size // tp_size
    stage_rank = rank // tp_size
    stage = PipelineStage(stage_rank, pp_size, *layers[stage_rank])
    if pp_size == 1:
        group = TensorParallelGroup(rank, world_size, dist.group.WORLD)
        pipeline = PipelineGroup(stage, tp_size, rank)
    else:
        stage_groups = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size))) for s in range(pp_size)]
        group = TensorParallelGroup(rank % tp_size, tp_size, stage_groups[stage_rank] if tp_size > 1 else None)
        pipeline = PipelineGroup(stage, tp_size, rank % tp_size, dist.group.WORLD)
    group.use_shared_memory_if_one_host(device)
    return group, pipeline


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free now; picked at run time so engines on one host coexist."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def divide(numerator: int, denominator: int) -> int:
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
    return numerator // denominator


# --- which device a rank uses ---------------------------------------------------------------------

def local_device_index(rank: int, launched_by_torchrun: bool, environ=os.environ) -> int:
    """The GPU of this node that a rank uses: LOCAL_RANK under torchrun (on a node whose ranks are not
    numbered from 0 the rank itself would be wrong), the rank when the engine spawned its ranks on
    one node, GPU 0 for every rank in the one-GPU test mode."""
    if one_gpu_test_mode():
        return 0
    if launched_by_torchrun and "LOCAL_RANK" in environ:
        return int(environ["LOCAL_RANK"])
    return rank


def resolve_device(device: str, index: int = 0) -> torch.device:
    """The torch device that the `device` setting means for a rank using GPU `index` of its node."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for, but torch sees no CUDA device")
        if index >= torch.cuda.device_count():
            raise ValueError(f"this rank would use GPU {index}, but {torch.cuda.device_count()} GPU(s) are visible")
        return torch.device("cuda", index)
    return torch.device("cpu")


def check_gpus_for(tensor_parallel_size: int, device: str) -> None:
    """ValueError when the engine would spawn more ranks than there are GPUs (two ranks on one GPU)."""
    if device == "cpu" or not torch.cuda.is_available() or one_gpu_test_mode() or dist.is_initialized():
        return
    visible = torch.cuda.device_count()
    if tensor_parallel_size > visible:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} needs one GPU per rank, "
                         f"but {visible} GPU(s) are visible")


def init_torchrun_process_group(device: str) -> torch.device:
    """Join the process group torchrun's variables describe (env://) on this rank's device; the
    launch scripts call it first thing."""
    # LOCAL_RANK names this rank's GPU
    device = resolve_device(device, local_device_index(int(os.environ["RANK"]), launched_by_torchrun=True))
    backend = pick_backend(device)
    if backend == "nccl":
        torch.cuda.set_device(device)  # first: the communicator binds to the current device
        dist.init_process_group(backend, device_id=device)
    else:
        dist.init_process_group(backend)
    return device
