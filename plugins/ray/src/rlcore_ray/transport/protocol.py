"""The control side of the source-mapped transport: its error, the channel it speaks over, dtype
names on the wire, and the per-phase timer of a push.

One push (sender ``S``, receiver ``R``, see :mod:`.mapped`)::

    S: ("map", version, layout_id, layout | None, checksums | None)
    R: ("mapped", version, level, checked, phases)      # or ("error", text)

Messages are small tuples; the bytes themselves never travel on the channel (the receiver reads
the sender's storages). A channel is anything with ``send(msg)``, ``recv(timeout)`` and
``poll(timeout)``: in a run, ``rlcore_ray.mapped_sync.FleetChannel`` (one Ray call per replica).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch
from rlcore.errors import WeightSyncError


class TransportError(WeightSyncError):
    """The transport failed: a peer refused, died, timed out or broke the protocol."""

    def __init__(self, message: str, receiver_version: int | None = None):
        super().__init__(message, receiver_version=receiver_version)


class ChannelClosed(TransportError):
    """The peer closed the channel: its process is gone, and with it every read it was making."""


class Channel(Protocol):
    """Carries the small control messages between the two ends (both directions)."""

    def send(self, msg: tuple) -> None: ...

    def recv(self, timeout: float | None) -> tuple: ...

    def poll(self, timeout: float = 0.0) -> bool: ...


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise TransportError(f"unknown dtype {name!r} in a transport message")
    return dt


class Phases:
    """Wall time per named phase (seconds), accumulated with ``with phases("copy"):``."""

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
