"""Bucket buffers in shared memory, for a vLLM worker in another process to read in place.

:class:`SharedBucketPool` is an ``allocator`` for :func:`rlcore.sync.iter_buckets`: the core
bucket builder writes each bucket straight into a file-backed shared mapping (``/dev/shm``), the
worker maps the same file and loads from views of it, so a bucket's bytes are copied once on the
trainer side (into the bucket) and once on the worker side (into the parameters). Segments are
reused across buckets and pushes (their pages stay resident), which is what makes a push run at
memory bandwidth rather than page-fault speed.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import Any

import torch
from rlcore_enginekit.shared_memory import map_segment, shm_directory

__all__ = ["Segment", "SharedBucketPool", "map_segment", "shm_directory"]


@dataclass
class Segment:
    path: str
    capacity: int
    tensor: torch.Tensor


class SharedBucketPool:
    """Allocates bucket buffers as shared-memory segments and recycles them."""

    def __init__(self, directory: str | None = None, prefix: str = "rlcore-vllm"):
        self.directory = directory or shm_directory()
        self.prefix = f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._by_ptr: dict[int, Segment] = {}
        self._free: list[Segment] = []
        self._count = 0

    def allocate(self, nbytes: int, device: Any = None) -> torch.Tensor:
        """``iter_buckets`` allocator: a free segment that fits, else a new one."""
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError("shared-memory buckets live on the CPU: call iter_buckets(..., device='cpu')")
        fits = [s for s in self._free if s.capacity >= nbytes]
        if fits:
            seg = min(fits, key=lambda s: s.capacity)
            self._free.remove(seg)
        else:
            path = os.path.join(self.directory, f"{self.prefix}-{self._count}")
            self._count += 1
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, nbytes)
            finally:
                os.close(fd)
            seg = Segment(path, nbytes, map_segment(path, nbytes))
        self._by_ptr[seg.tensor.data_ptr()] = seg
        # exactly the requested size: a recycled larger segment must not make a larger bucket
        return seg.tensor[:nbytes]

    def segment_of(self, buffer: torch.Tensor) -> Segment:
        """The segment a bucket's buffer (a prefix view of one) lives in."""
        seg = self._by_ptr.get(buffer.data_ptr())
        if seg is None:
            raise ValueError("buffer was not allocated by this pool")
        return seg

    def release(self, buffer: torch.Tensor) -> None:
        """The consumer is done with this bucket: its segment may hold the next one."""
        seg = self._by_ptr.pop(buffer.data_ptr(), None)
        if seg is not None:
            self._free.append(seg)

    def release_all(self) -> None:
        """After a push (finished or failed): every segment is free again."""
        self._free.extend(self._by_ptr.values())
        self._by_ptr.clear()

    @property
    def paths(self) -> list[str]:
        return [s.path for s in self._free] + [s.path for s in self._by_ptr.values()]

    @property
    def resident_bytes(self) -> int:
        return sum(s.capacity for s in self._free) + sum(s.capacity for s in self._by_ptr.values())

    def close(self) -> None:
        """Unlink every segment (a mapping another process still holds stays valid until it drops it)."""
        for path in self.paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._free.clear()
        self._by_ptr.clear()

    def __del__(self) -> None:  # a pool dropped without close() must not leak /dev/shm files
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
