"""Test-only fault injection: kill the process with SIGKILL at a named point, deterministically.

``RLCORE_FAULT=<point>[:<n>]`` kills the process the ``n``-th time (default: the first) it
reaches ``<point>``; ``<point>:<n>:hang`` instead makes that thread stop answering (it sleeps
for an hour), for the tests of the overlapped loop's timeouts. Several faults: separate them with
commas (``producer:2:hang,push_in_flight``). Points (see docs/reliability.md):

``rollout``           right after the rollout backend returned a step's samples
``push``              mid-push: the sync has taken the first tensor of the export stream
``checkpoint_write``  the checkpoint's state file is written to its temporary name, not renamed
``checkpoint_meta``   the state file is in place, its metadata (the commit record) is not
``producer``          the rollout producer thread (loop.mode one_step_off/async) got a generate call's samples
``push_in_flight``    a push starts while generate calls are in flight (loop.in_flight=abort)

Unset (every real run), :func:`fault_point` is one dictionary lookup.
"""

from __future__ import annotations

import os
import signal
import time

ENV = "RLCORE_FAULT"
POINTS = ("rollout", "push", "checkpoint_write", "checkpoint_meta", "producer", "push_in_flight")
ACTIONS = ("kill", "hang")
HANG_S = 3600.0
_hits: dict[str, int] = {}


def fault_point(name: str) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    faults = [_parse(spec, one) for one in spec.split(",")]
    hits = [(count, action) for point, count, action in faults if point == name]
    if not hits:
        return
    _hits[name] = _hits.get(name, 0) + 1
    for count, action in hits:
        if _hits[name] == count:
            if action == "hang":
                time.sleep(HANG_S)
            else:
                os.kill(os.getpid(), signal.SIGKILL)


def _parse(spec: str, one: str) -> tuple[str, int, str]:
    point, _, rest = one.strip().partition(":")
    count, _, action = rest.partition(":")
    if point not in POINTS:
        raise ValueError(f"{ENV}={spec!r}: unknown point {point!r}; known: {', '.join(POINTS)}")
    if action and action not in ACTIONS:
        raise ValueError(f"{ENV}={spec!r}: unknown action {action!r}; known: {', '.join(ACTIONS)}")
    return point, int(count or 1), action
