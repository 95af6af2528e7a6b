"""Stopping a run with SIGINT (Ctrl-C) or SIGTERM (a scheduler's stop) without damaging it.

The first signal during the steps asks the trainer to stop at the next step boundary: the step
in progress finishes, the last finished step is checkpointed, and ``rlcore train`` exits with
128 + the signal number and says how to resume. A second signal, or one that arrives before the
steps begin, stops at once by raising :class:`StopNow` where the process is: every checkpoint
write is atomic and removes its temporary file on the way out, so the last committed checkpoint
stays intact, and a new run whose start is stopped removes what it created.
"""

from __future__ import annotations

import shlex
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopNow(KeyboardInterrupt):
    """Raised by a stop signal that cannot wait for the step boundary. A KeyboardInterrupt, so
    that no ``except Exception`` on the way out swallows it."""

    def __init__(self, signum: int, out: Path | None = None):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.out = signum, out


class StopSignals:
    """SIGINT/SIGTERM handlers for one run (the main thread only: Python delivers signals there).
    ``stepping`` is set while the steps run: only then may a first signal wait for the boundary;
    ``requested`` is the signal that asked for it."""

    def __init__(self, out: Path, step: Callable[[], int]):
        self.out, self._step = out, step
        self.requested: int | None = None
        self.stepping = False
        self._old: dict[int, Any] = {}

    def install(self, enabled: bool = True) -> StopSignals:
        if enabled and threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested is not None or not self.stepping:
            raise StopNow(signum, self.out)
        self.requested = signum
        print(f"rlcore: {signal.Signals(signum).name} received, stopping after step {self._step()} "
              f"(its checkpoint is written next); send it again to stop at once", file=sys.stderr, flush=True)


def exit_code(signum: int) -> int:
    """What a shell reports for a process ended by ``signum``: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + int(signum)


def resume_command(config: str, overrides: Sequence[str], out: Path | str, extra: Sequence[str] = ()) -> str:
    """The ``rlcore train`` line that continues the run in ``out``."""
    return shlex.join(["rlcore", "train", config, *overrides, "--output", str(out), "--resume", *extra])


class StopToException:
    """For the whole ``rlcore train`` command: SIGTERM raises :class:`StopNow` (as SIGINT raises
    KeyboardInterrupt) so that a stop while the trainer is built unwinds through its clean-up;
    the trainer's own handlers take over while it runs."""

    def __enter__(self) -> StopToException:
        self._old = None
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, self._raise)
        return self

    @staticmethod
    def _raise(signum: int, frame: Any) -> None:
        raise StopNow(signum)

    def __exit__(self, *exc: Any) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)
