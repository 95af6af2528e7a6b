"""The control side of :mod:`rlcore.transport`: messages, the channel, the hand-back ledger and
the splitting of tensors larger than a buffer.

Messages are small tuples (``(kind, ...)``) sent over a :class:`Channel`; bucket bytes never
travel on it. One push, sender ``S`` and receiver ``R``::

    S: ("begin", version, plane description, slot_bytes, num_slots)
    R: ("ready", version, plane reply)                 # or ("error", text)
    S: ("bucket", index, slot, nbytes, tensors, parts, checksum | None)     (per bucket)
    R: ("release", slot, index)                        # the explicit hand-back of that buffer
    S: ("end", version, num_tensors, num_buckets, nbytes)
    R: ("done", version, level, checked, phases)       # or ("error", text)
    S: ("abort", version, reason)                      # instead of "end", when the sender fails

``tensors`` is ``[(name, dtype, shape, offset, nbytes)]`` with dtype names such as ``"bfloat16"``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import torch

from rlcore.errors import WeightSyncError

#: separator of the name of one piece of a tensor larger than a buffer
PART_SEP = ".__rlcore_part_"


class TransportError(WeightSyncError):
    """The transport failed: a peer refused, died, timed out or broke the protocol."""

    def __init__(self, message: str, receiver_version: int | None = None):
        super().__init__(message, receiver_version=receiver_version)


class Channel(Protocol):
    """Carries the small control messages between the two ends (both directions)."""

    def send(self, msg: tuple) -> None: ...

    def recv(self, timeout: float | None) -> tuple: ...

    def poll(self, timeout: float = 0.0) -> bool: ...


class PipeChannel:
    """A :class:`Channel` over a ``multiprocessing`` connection: one end of ``mp.Pipe()`` (what the
    two processes of a test or a colocated pair share), or a ``multiprocessing.connection``
    ``Client``/``Listener`` connection between hosts. Messages are pickled, so CUDA IPC handles
    travel as the plain tuples :mod:`torch.multiprocessing.reductions` makes of them."""

    def __init__(self, conn: Any, peer: str = "peer"):
        self.conn = conn
        self.peer = peer

    def send(self, msg: tuple) -> None:
        try:
            self.conn.send(msg)
        except (BrokenPipeError, EOFError, ConnectionResetError, OSError) as exc:
            raise TransportError(f"the {self.peer} closed the channel ({type(exc).__name__}); did it die?") from exc

    def poll(self, timeout: float = 0.0) -> bool:
        try:
            return bool(self.conn.poll(timeout))
        except (EOFError, OSError) as exc:
            raise TransportError(f"the {self.peer} closed the channel ({type(exc).__name__}); did it die?") from exc

    def recv(self, timeout: float | None) -> tuple:
        if timeout is not None and not self.poll(timeout):
            raise TransportError(f"no message from the {self.peer} in {timeout:g} s (sync.transport timeout)")
        try:
            return self.conn.recv()
        except (EOFError, OSError) as exc:
            raise TransportError(f"the {self.peer} closed the channel ({type(exc).__name__}); did it die?") from exc

    def close(self) -> None:
        self.conn.close()


class ChannelListener:
    """Where one end waits for the other over TCP, for processes that share no pipe (Ray actors,
    processes on two hosts): ``address`` and ``authkey`` go to the peer, which calls
    :func:`connect_channel`; :meth:`accept` returns the :class:`PipeChannel`. The authkey keeps
    other processes out (``multiprocessing.connection``'s HMAC challenge)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, authkey: bytes | None = None):
        import os
        from multiprocessing.connection import Listener

        self.authkey = authkey if authkey is not None else os.urandom(32)
        self._listener = Listener((host, port), authkey=self.authkey)

    @property
    def address(self) -> tuple[str, int]:
        return self._listener.address

    def accept(self, peer: str = "peer") -> PipeChannel:
        return PipeChannel(self._listener.accept(), peer)

    def close(self) -> None:
        self._listener.close()


def connect_channel(address: tuple[str, int], authkey: bytes, peer: str = "peer") -> PipeChannel:
    """The other end of a :class:`ChannelListener`."""
    from multiprocessing.connection import Client

    return PipeChannel(Client(tuple(address), authkey=authkey), peer)


def expect(channel: Channel, kinds: tuple[str, ...], timeout: float | None, peer: str) -> tuple:
    """The next message, which must be one of ``kinds``; a peer's ``error`` becomes a raise."""
    msg = channel.recv(timeout)
    if msg[0] == "error":
        raise TransportError(f"the {peer} failed: {msg[1]}")
    if msg[0] not in kinds:
        raise TransportError(f"protocol error: expected {'/'.join(kinds)} from the {peer}, got {msg[0]!r}")
    return msg


class SlotLedger:
    """Who may touch each buffer. A slot is ``free``, ``filling`` (the sender writes it) or
    ``lent`` (announced to the receiver, which may read it until it hands it back). Only a free
    slot is ever filled, and only an explicit hand-back frees a lent one: the sender can never
    overwrite a bucket the receiver may still be reading (verl #7139)."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.state = ["free"] * num_slots
        self.max_lent = 0

    def take(self) -> int | None:
        for i, s in enumerate(self.state):
            if s == "free":
                self.state[i] = "filling"
                return i
        return None

    def lend(self, slot: int) -> None:
        if self.state[slot] != "filling":
            raise TransportError(f"slot {slot} is {self.state[slot]}, cannot be lent")
        self.state[slot] = "lent"
        self.max_lent = max(self.max_lent, self.state.count("lent"))

    def hand_back(self, slot: int) -> None:
        if not 0 <= slot < len(self.state) or self.state[slot] != "lent":
            state = self.state[slot] if 0 <= slot < len(self.state) else "unknown"
            raise TransportError(f"protocol error: the receiver handed back slot {slot}, which is {state}")
        self.state[slot] = "free"

    def reset(self) -> None:
        self.state = ["free"] * len(self.state)

    @property
    def lent(self) -> list[int]:
        return [i for i, s in enumerate(self.state) if s == "lent"]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise TransportError(f"unknown dtype {name!r} in a bucket message")
    return dt


def split_oversize(weights: Iterable[tuple[str, torch.Tensor]], limit: int,
                   parts: dict[str, tuple[str, str, tuple[int, ...], int, int]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass tensors through; one larger than ``limit`` bytes goes as ``uint8`` pieces of at most
    ``limit`` bytes named ``<name>.__rlcore_part_<i>_of_<n>``, recorded in ``parts`` as
    ``piece name -> (name, dtype, shape, byte offset, total bytes)``. The receiver reassembles
    them in a buffer of its own, so the sender never holds more than its fixed buffers."""
    for name, t in weights:
        nbytes = t.numel() * t.element_size()
        if nbytes <= limit:
            yield name, t
            continue
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        n = math.ceil(nbytes / limit)
        for i in range(n):
            piece = f"{name}{PART_SEP}{i}_of_{n}"
            parts[piece] = (name, dtype_name(t.dtype), tuple(t.shape), i * limit, nbytes)
            yield piece, flat[i * limit:(i + 1) * limit]


class Phases:
    """Wall time per named phase (seconds), accumulated with ``with phases("fill"):``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def __call__(self, name: str) -> _Timer:
        return _Timer(self, name)

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 6) for k, v in self.seconds.items()}


class _Timer:
    def __init__(self, phases: Phases, name: str):
        self.phases, self.name = phases, name

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        self.phases.add(self.name, time.perf_counter() - self.t0)
