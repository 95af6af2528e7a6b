"""Calling the reward function: once per sample, on the writer rank only, each call bounded in time,
each failure a :class:`~rlcore.errors.RewardError` that names the function and the sample.

* **Time.** ``data.reward_timeout_seconds`` (default 60, 0 = no limit) bounds every call. Python
  cannot stop a function that never returns, so with a limit the calls run in a worker thread (a
  daemon, one per trainer, kept between steps so that a function's thread-local client or cache
  lives on). When a call overruns, the run stops naming the function, the sample and the limit;
  the stuck call is abandoned (its thread runs on until the process exits). The worker scores a
  whole step and says which call it is in, so the per-call limit costs one thread hand-off per
  step, not one per sample.
* **Exceptions** raised by the function become a ``RewardError`` naming the exception, where it
  was raised, the sample and the step (the original is chained).
* **Values** are checked by :func:`rlcore.guards.checked_reward`: real numbers (``int``,
  ``float``, NumPy integer and floating scalars, one-element tensors and arrays), finite, within
  :data:`rlcore.guards.REWARD_LIMIT`.
* **Ranks.** Several data-parallel ranks share one step's samples: the writer scores them and
  hands the rewards (or the error) to every rank. Scoring on each rank would call a paid judge
  ``world`` times, let a judge that answers differently split the ranks, and let one rank's
  timeout leave the others waiting in the next collective.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from rlcore.errors import RewardError
from rlcore.guards import checked_reward, shorten
from rlcore.ranks import Ranks

#: the config key of the per-call limit (named in the timeout error)
TIMEOUT_KEY = "data.reward_timeout_seconds"


def call_reward(fn: Callable[[Any], Any], name: str, x: Any, where: str, in_thread: bool = False) -> float:
    """``fn(x)`` as a checked float; ``where`` names the sample and the step."""
    try:
        value = fn(x)
    except Exception as exc:  # noqa: BLE001 - any failure of user code is reported as the reward's
        frames = traceback.extract_tb(exc.__traceback__)
        at = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
        # signal.signal and asyncio's get_event_loop work on the main thread only
        off_main = in_thread or threading.current_thread() is not threading.main_thread()
        hint = (f"; the reward runs off the main thread (in a worker thread while {TIMEOUT_KEY} > 0, on the "
                f"rollout producer's thread while loop.mode is not sync): a reward that needs the main thread "
                f"needs both {TIMEOUT_KEY}=0 and loop.mode=sync" if off_main and "thread" in str(exc) else "")
        raise RewardError(f"reward function {name} raised {type(exc).__name__}: {shorten(str(exc), 200)}{at} "
                          f"on {where}{hint}") from exc
    return checked_reward(value, f"reward function {name} returned {shorten(repr(value))} for {where}")


class _Step:
    """One step's calls, run by the worker thread. ``current`` is the index and start time of the
    call in progress; ``abandoned`` tells the worker to stop (the trainer stopped waiting)."""

    def __init__(self, fn: Callable[[Any], Any], name: str, inputs: Sequence[Any], where: Callable[[int], str]):
        self.fn, self.name, self.inputs, self.where = fn, name, inputs, where
        self.values: list[float] = []
        self.error: BaseException | None = None
        self.current = (0, time.monotonic())
        self.done = threading.Event()
        self.abandoned = False

    def run(self) -> None:
        try:
            for i, x in enumerate(self.inputs):
                if self.abandoned:
                    return
                self.current = (i, time.monotonic())
                self.values.append(call_reward(self.fn, self.name, x, self.where(i), in_thread=True))
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer's thread, raised there
            self.error = exc
        finally:
            self.done.set()


def _serve(jobs: queue.SimpleQueue) -> None:
    while True:
        step = jobs.get()
        if step is None:
            return
        step.run()
        if step.abandoned:  # a call overran; a new worker serves the next step
            return
        del step  # hold nothing of a finished step while waiting for the next


class RewardCalls:
    """The reward function ``fn`` (config ``name``), called per sample with a per-call limit of
    ``timeout_seconds`` (0: none, called on the caller's thread)."""

    def __init__(self, fn: Callable[[Any], Any], name: str, timeout_seconds: float):
        self.fn, self.name, self.timeout = fn, name, float(timeout_seconds or 0)
        self._jobs: queue.SimpleQueue | None = None

    def score(self, inputs: Sequence[Any], where: Callable[[int], str]) -> list[float]:
        """The reward of every input, in order; ``where(i)`` names sample ``i`` and the step."""
        if self.timeout <= 0:
            return [call_reward(self.fn, self.name, x, where(i)) for i, x in enumerate(inputs)]
        step = _Step(self.fn, self.name, inputs, where)
        self._worker().put(step)
        try:
            self._wait(step)
        except BaseException:
            self._abandon(step)
            raise
        if step.error is not None:
            raise step.error
        return step.values

    def _wait(self, step: _Step) -> None:
        while not step.done.is_set():
            call = step.current
            left = call[1] + self.timeout - time.monotonic()
            if left > 0:
                step.done.wait(left)
            elif step.current == call and not step.done.is_set():
                raise RewardError(
                    f"reward function {self.name} did not return within {self.timeout:g} s ({TIMEOUT_KEY}) on "
                    f"{step.where(call[0])}: the run stops and the stuck call is abandoned (it runs on in a "
                    f"background thread until this process exits); make the function return in time, or raise "
                    f"{TIMEOUT_KEY} (0 = no limit)")

    def _abandon(self, step: _Step) -> None:
        step.abandoned = True
        self._jobs = None  # the worker may never come back: the next step gets a new one

    def _worker(self) -> queue.SimpleQueue:
        if self._jobs is None:
            jobs: queue.SimpleQueue = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(jobs,), name=f"rlcore reward {self.name}", daemon=True).start()
            weakref.finalize(self, jobs.put, None)  # the worker ends with its trainer
            self._jobs = jobs
        return self._jobs


def score_on_writer(ranks: Ranks, calls: RewardCalls, inputs: Sequence[Any], where: Callable[[int], str]) -> list[float]:
    """``calls.score`` on the writer rank; its rewards, or its error, on every rank. (An error
    crosses as its class, message and attributes: rlcore's errors need not be picklable.)"""
    if not ranks.distributed:
        return calls.score(inputs, where)
    outcome: tuple[Any, ...] = ()
    failed: Exception | None = None
    if ranks.writer:
        try:
            outcome = ("ok", calls.score(inputs, where))
        except Exception as exc:  # noqa: BLE001 - raised again on every rank below
            failed, outcome = exc, ("error", type(exc), str(exc), dict(vars(exc)))
    outcome = ranks.broadcast(outcome)
    if outcome[0] == "ok":
        return outcome[1]
    if failed is not None:
        raise failed  # the writer's own, with its traceback and cause
    _, cls, message, attrs = outcome
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    vars(error).update(attrs)
    raise error
