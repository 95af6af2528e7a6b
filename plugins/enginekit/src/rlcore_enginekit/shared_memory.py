"""Shared-memory segments that two processes of one host map (``MAP_SHARED`` files).

A writer creates a file (in :func:`shm_directory`), maps it with :func:`map_segment` and fills
it; a reader in another process maps the same path and reads in place. rlcore-vllm's bucket pool
(``rlcore_vllm.shm``) and its worker extension use these, so that a bucket's bytes are copied
once on each side and never pickled.
"""

from __future__ import annotations

import os
import tempfile

import torch

__all__ = ["map_segment", "shm_directory"]


def shm_directory() -> str:
    """``/dev/shm`` where it exists and is writable (RAM-backed), else the temp dir."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def map_segment(path: str, capacity: int) -> torch.Tensor:
    """A ``uint8 [capacity]`` tensor over the shared file at ``path`` (MAP_SHARED): writes are
    seen by every process that maps it."""
    return torch.from_file(path, shared=True, size=capacity, dtype=torch.uint8)
