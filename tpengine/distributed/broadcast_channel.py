"""Message broadcast over a torch.distributed (gloo) group, for ranks on other hosts.

Same surface as the shared-memory ring: ``write(payload)`` on ``src``, ``read()``
everywhere else. Each message is two collective broadcasts: its length as one
int64, then its bytes as uint8.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["BroadcastChannel"]


class BroadcastChannel:
    """Every rank of ``group`` must call ``write`` (on ``src``) or ``read`` (elsewhere) per message.

    ``group`` is any gloo process group, registered with torch.distributed (None: the global one)
    or an engine's own; ``src`` is a rank within it.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, src: int = 0) -> None:
        self._group = dist.group.WORLD if group is None else group
        self._src = src
        self._is_src = self._group.rank() == src
        self._options = dist.BroadcastOptions()
        self._options.rootRank = src

    def write(self, payload: bytes | bytearray | memoryview) -> None:
        if not self._is_src:
            raise RuntimeError(f"only rank {self._src} writes to this channel")
        data = bytearray(payload)  # torch.frombuffer wants a writable buffer
        self._broadcast(torch.tensor([len(data)], dtype=torch.int64))
        if data:
            self._broadcast(torch.frombuffer(data, dtype=torch.uint8))

    def read(self) -> bytes:
        if self._is_src:
            raise RuntimeError(f"rank {self._src} is the writer of this channel")
        length = torch.empty(1, dtype=torch.int64)
        self._broadcast(length)
        data = bytearray(int(length.item()))
        if data:  # torch.frombuffer rejects an empty buffer
            self._broadcast(torch.frombuffer(data, dtype=torch.uint8))
        return bytes(data)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        self._group.broadcast([tensor], self._options).wait()
