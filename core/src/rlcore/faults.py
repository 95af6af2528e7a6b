"""Test-only fault injection: kill the process with SIGKILL at a named point, deterministically.

``RLCORE_FAULT=<point>[:<n>]`` kills the process the ``n``-th time (default: the first) it
reaches ``<point>``. Points (see docs/reliability.md):

``rollout``           right after the rollout backend returned a step's samples
``push``              mid-push: the sync has taken the first tensor of the export stream
``checkpoint_write``  the checkpoint's state file is written to its temporary name, not renamed
``checkpoint_meta``   the state file is in place, its metadata (the commit record) is not

Unset (every real run), :func:`fault_point` is one dictionary lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "RLCORE_FAULT"
POINTS = ("rollout", "push", "checkpoint_write", "checkpoint_meta")
_hits: dict[str, int] = {}


def fault_point(name: str) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    point, _, count = spec.partition(":")
    if point not in POINTS:
        raise ValueError(f"{ENV}={spec!r}: unknown point {point!r}; known: {', '.join(POINTS)}")
    if point != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] == int(count or 1):
        os.kill(os.getpid(), signal.SIGKILL)
