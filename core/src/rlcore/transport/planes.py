"""Where bucket bytes travel (the data planes of :mod:`rlcore.transport`).

Each plane has a sender half, which owns ``num_slots`` fixed buffers of ``slot_bytes`` and
describes them to the receiver once per push, and a receiver half, which attaches to that
description and yields a readable view of a slot. The hand-back of a slot (the ``release``
message) is always explicit; a plane only adds what its memory needs on top of it:

* :class:`ShmPlane` (CPU, every platform): the slots are files in ``/dev/shm`` mapped by both
  processes. Writes before the ``bucket`` message are visible to the reader (the pipe is a
  barrier); the receiver reads in place.
* :class:`CudaIpcPlane` (one GPU shared by two processes): the slots are CUDA buffers opened by
  the receiver through CUDA IPC. Ordering stays on the GPU: the sender records an interprocess
  event after filling a slot and the receiver's stream waits on it; the receiver records its own
  event after its reads of the slot, before handing it back, and the sender's stream waits on
  that one before writing the slot again. Neither side blocks its CPU on the GPU.
* :class:`DistPlane` (gloo on CPU, NCCL to disaggregated engines): the slots are broadcast from
  the sending rank over a ``torch.distributed`` group into buffers the receiver owns, one per
  slot; a slot's broadcast is posted by the receiver only when it handles that slot's message.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import torch

from rlcore.shared_memory import map_segment, shm_directory
from rlcore.transport.protocol import TransportError


def create_segment(path: str, capacity: int) -> torch.Tensor:
    """Create the file at ``path`` (it must not exist) and map it."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, capacity)
    finally:
        os.close(fd)
    return map_segment(path, capacity)


class SenderPlane:
    """Base of the sender halves: ``buffers`` are the slots."""

    kind = ""
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []

    def open(self, num_slots: int, slot_bytes: int) -> None:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        raise NotImplementedError

    def on_ready(self, reply: Any) -> None:
        """The receiver's answer to ``describe()`` (e.g. its event handles)."""

    def before_fill(self, slot: int) -> None:
        """The slot was handed back and is about to be written again."""

    def publish(self, slot: int, nbytes: int) -> None:
        """The slot holds a bucket: make it readable by the receiver (called after the
        ``bucket`` message is sent)."""

    def after_fill(self, slot: int) -> None:
        """The fill is complete in program order (called before the ``bucket`` message)."""

    def close(self) -> None:
        self.buffers = []


class ReceiverPlane:
    kind = ""

    def attach(self, desc: dict[str, Any]) -> Any:
        """Open the sender's slots; returns the reply for ``SenderPlane.on_ready``."""
        raise NotImplementedError

    def fetch(self, slot: int, nbytes: int) -> torch.Tensor:
        """A readable ``uint8 [nbytes]`` view of the bucket in ``slot``."""
        raise NotImplementedError

    def finished(self, slot: int) -> None:
        """Every read of the slot is issued; after this the slot may be handed back."""

    def discard(self, slot: int, nbytes: int) -> None:
        """A bucket of a push this side already failed: take part in its transfer, keep nothing."""

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------- shm (CPU) -----


class ShmPlane(SenderPlane):
    kind = "shm"

    def __init__(self, directory: str | None = None):
        super().__init__()
        self.directory = directory or shm_directory()
        self.paths: list[str] = []

    def open(self, num_slots: int, slot_bytes: int) -> None:
        if self.buffers and len(self.buffers) == num_slots and self.buffers[0].numel() == slot_bytes:
            return  # the segments stay mapped (and their pages resident) across pushes
        self.close()
        prefix = os.path.join(self.directory, f"rlcore-transport-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self.paths = [f"{prefix}-{i}" for i in range(num_slots)]
        self.buffers = [create_segment(p, slot_bytes) for p in self.paths]

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "paths": list(self.paths), "slot_bytes": self.buffers[0].numel()}

    def close(self) -> None:
        for p in self.paths:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        self.paths = []
        super().close()

    def __del__(self) -> None:  # dropped without close(): leave no /dev/shm files behind
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class ShmReceiverPlane(ReceiverPlane):
    kind = "shm"

    def __init__(self) -> None:
        self.key: tuple = ()
        self.segments: list[torch.Tensor] = []

    def attach(self, desc: dict[str, Any]) -> Any:
        key = (tuple(desc["paths"]), desc["slot_bytes"])
        if key != self.key:
            self.segments = [map_segment(p, desc["slot_bytes"]) for p in desc["paths"]]
            self.key = key
        return None

    def fetch(self, slot: int, nbytes: int) -> torch.Tensor:
        return self.segments[slot][:nbytes]

    def close(self) -> None:
        self.segments = []
        self.key = ()


# ------------------------------------------------------------------ CUDA IPC (one GPU) -----


class CudaIpcPlane(SenderPlane):
    kind = "cuda_ipc"

    def __init__(self, device: torch.device | str | int | None = None):
        super().__init__()
        if not torch.cuda.is_available():
            raise TransportError("the cuda_ipc transport needs a CUDA GPU (use shm or gloo on CPU)")
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        self.filled: list[torch.cuda.Event] = []
        self.done: list[Any] = []
        self._desc: dict[str, Any] | None = None

    def open(self, num_slots: int, slot_bytes: int) -> None:
        if self.buffers and len(self.buffers) == num_slots and self.buffers[0].numel() == slot_bytes:
            return
        from torch.multiprocessing.reductions import reduce_tensor

        self.close()
        self.buffers = [torch.empty(slot_bytes, dtype=torch.uint8, device=self.device) for _ in range(num_slots)]
        self.filled = [torch.cuda.Event(interprocess=True) for _ in range(num_slots)]
        with torch.cuda.device(self.device):
            handles = [ev.ipc_handle() for ev in self.filled]
        self._desc = {"kind": self.kind, "slot_bytes": slot_bytes, "device": self.device.index,
                      "tensors": [reduce_tensor(b)[1] for b in self.buffers], "events": handles}
        self.done = []

    def describe(self) -> dict[str, Any]:
        assert self._desc is not None
        return self._desc

    def on_ready(self, reply: Any) -> None:
        if reply is not None:  # the receiver (re)attached: its events are new
            self.done = [torch.cuda.Event.from_ipc_handle(self.device, h) for h in reply]

    def before_fill(self, slot: int) -> None:
        if self.done:
            torch.cuda.current_stream(self.device).wait_event(self.done[slot])

    def after_fill(self, slot: int) -> None:
        self.filled[slot].record(torch.cuda.current_stream(self.device))

    def close(self) -> None:
        self.filled, self.done, self._desc = [], [], None
        super().close()


class CudaIpcReceiverPlane(ReceiverPlane):
    kind = "cuda_ipc"

    def __init__(self) -> None:
        self.key: Any = None
        self.slots: list[torch.Tensor] = []
        self.filled: list[Any] = []
        self.done: list[torch.cuda.Event] = []

    def attach(self, desc: dict[str, Any]) -> Any:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        key = tuple(bytes(h) for h in desc["events"])
        if key == self.key:
            return None
        device = torch.device("cuda", desc["device"])
        self.slots = [rebuild_cuda_tensor(*args) for args in desc["tensors"]]
        self.filled = [torch.cuda.Event.from_ipc_handle(device, h) for h in desc["events"]]
        self.done = [torch.cuda.Event(interprocess=True) for _ in self.slots]
        self.key = key
        with torch.cuda.device(device):
            return [ev.ipc_handle() for ev in self.done]

    def fetch(self, slot: int, nbytes: int) -> torch.Tensor:
        buf = self.slots[slot]
        torch.cuda.current_stream(buf.device).wait_event(self.filled[slot])
        return buf[:nbytes]

    def finished(self, slot: int) -> None:
        self.done[slot].record(torch.cuda.current_stream(self.slots[slot].device))

    def close(self) -> None:
        self.slots, self.filled, self.done, self.key = [], [], [], None


# --------------------------------------------------------- torch.distributed (gloo / NCCL) -----


class DistPlane(SenderPlane):
    """Broadcast from ``src`` (a global rank) over ``group`` (``None``: the default group)."""

    kind = "dist"

    def __init__(self, src: int, group: Any = None, device: torch.device | str | None = None):
        super().__init__()
        self.src, self.group = src, group
        self.device = torch.device(device) if device is not None else torch.device("cpu")

    def open(self, num_slots: int, slot_bytes: int) -> None:
        if self.buffers and len(self.buffers) == num_slots and self.buffers[0].numel() == slot_bytes:
            return
        self.buffers = [torch.empty(slot_bytes, dtype=torch.uint8, device=self.device) for _ in range(num_slots)]

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "slot_bytes": self.buffers[0].numel(), "num_slots": len(self.buffers)}

    def publish(self, slot: int, nbytes: int) -> None:
        import torch.distributed as dist

        # stream-ordered on NCCL: a later fill of this slot (same stream) runs after the send
        dist.broadcast(self.buffers[slot][:nbytes], src=self.src, group=self.group)


class DistReceiverPlane(ReceiverPlane):
    kind = "dist"

    def __init__(self, src: int, group: Any = None, device: torch.device | str | None = None):
        self.src, self.group = src, group
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.slots: list[torch.Tensor] = []

    def attach(self, desc: dict[str, Any]) -> Any:
        n, size = desc["num_slots"], desc["slot_bytes"]
        if len(self.slots) != n or (self.slots and self.slots[0].numel() != size):
            self.slots = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(n)]
        return None

    def fetch(self, slot: int, nbytes: int) -> torch.Tensor:
        import torch.distributed as dist

        view = self.slots[slot][:nbytes]
        dist.broadcast(view, src=self.src, group=self.group)
        return view

    def discard(self, slot: int, nbytes: int) -> None:
        self.fetch(slot, nbytes)

    def close(self) -> None:
        self.slots = []


def receiver_plane_for(desc_kind: str, **kwargs: Any) -> ReceiverPlane:
    """The receiver half matching a sender's ``describe()["kind"]`` (shm and cuda_ipc need no
    arguments; dist needs ``src``, ``group`` and ``device``)."""
    if desc_kind == "shm":
        return ShmReceiverPlane()
    if desc_kind == "cuda_ipc":
        return CudaIpcReceiverPlane()
    if desc_kind == "dist":
        return DistReceiverPlane(**kwargs)
    raise TransportError(f"unknown transport plane {desc_kind!r}; known: shm, cuda_ipc, dist")
