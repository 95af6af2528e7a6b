"""The writer rank's memory during a weight push: what a push costs beside the model.

Issue 15 asks that a push hold about two buckets beside the model, never the whole model, and
that this is measured. A distributed rank strategy (:mod:`rlcore.parallel.strategy`) hands the
writer's push a :class:`PeakResident`, which samples the process's resident set size every
millisecond and at every exported tensor (the trainer calls :meth:`PeakResident.sample`), and
whose :meth:`~PeakResident.metrics` go into the step's metrics: ``push_peak_extra_rss_mib`` (all
resident memory above the value before the push) and ``push_peak_extra_private_mib`` (without
shared pages: Ray's object store and lent shared-memory parameters are shared). One process
measures nothing (:data:`NO_METER`).
"""

from __future__ import annotations

import os
import threading
from typing import Any

MIB = 1 << 20


def resident_bytes() -> tuple[int, int]:
    """This process's resident set size and its private (anonymous) part, in bytes (Linux
    ``/proc/self/statm``: resident minus shared pages; Ray's object store is shared memory, so
    a bucket put there counts in the first only). ``(0, 0)`` where the file is missing."""
    try:
        with open("/proc/self/statm") as f:
            fields = f.read().split()
        page = os.sysconf("SC_PAGE_SIZE")
        return int(fields[1]) * page, (int(fields[1]) - int(fields[2])) * page
    except (OSError, ValueError, IndexError):
        return 0, 0


class PeakResident:
    """The peak resident set size (and its private part) above the values at entry, sampled by a
    thread every ``interval_s`` and by :meth:`sample` (called where the peak is expected)."""

    def __init__(self, interval_s: float = 0.001):
        self.interval_s = interval_s
        self.base = self.peak = (0, 0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        now = resident_bytes()
        self.peak = (max(self.peak[0], now[0]), max(self.peak[1], now[1]))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> PeakResident:
        self.base = self.peak = resident_bytes()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()

    @property
    def extra_bytes(self) -> int:
        return self.peak[0] - self.base[0]

    @property
    def extra_private_bytes(self) -> int:
        return self.peak[1] - self.base[1]

    def metrics(self) -> dict[str, float]:
        return {"push_peak_extra_rss_mib": self.extra_bytes / MIB,
                "push_peak_extra_private_mib": self.extra_private_bytes / MIB}


class NoMeter:
    """A push that is not measured."""

    def __enter__(self) -> NoMeter:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def sample(self) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {}


NO_METER = NoMeter()
#: what a rank strategy measures a push with
PushMeter = PeakResident | NoMeter
