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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from rlcore.errors import RewardError
from rlcore.guards import checked_reward, shorten
from rlcore.ranks import Ranks

#: the config key of the per-call limit (named in the timeout error)
TIMEOUT_KEY = "data.reward_timeout_seconds"
#: where a sample keeps its reward's named components (``Sample.extras``)
REWARD_COMPONENTS = "reward_components"

#: a checked reward: one float, or named components
RewardValue = float | dict[str, float]


def checked_reward_value(value: Any, where: str) -> RewardValue:
    """A real reward as a float, or a non-empty mapping of component names to real rewards as a
    dict of floats (each checked as a single reward, the error naming the component)."""
    if not isinstance(value, Mapping):
        return checked_reward(value, where)
    if not value:
        raise RewardError(f"{where}; a dict of reward components needs at least one component")
    out = {}
    for key, part in value.items():
        if not isinstance(key, str) or not key:
            raise RewardError(f"{where}; reward component names must be non-empty strings, not {key!r}")
        out[key] = checked_reward(part, f"{where} (component {key!r})")
    return out


def call_reward(fn: Callable[[Any], Any], name: str, x: Any, where: str, in_thread: bool = False) -> RewardValue:
    """``fn(x)`` checked (a float or a dict of named floats); ``where`` names the sample and the step."""
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
    return checked_reward_value(value, f"reward function {name} returned {shorten(repr(value))} for {where}")


class _Step:
    """One step's calls, run by the worker thread. ``current`` is the index and start time of the
    call in progress; ``abandoned`` tells the worker to stop (the trainer stopped waiting)."""

    def __init__(self, fn: Callable[[Any], Any], name: str, inputs: Sequence[Any], where: Callable[[int], str]):
        self.fn, self.name, self.inputs, self.where = fn, name, inputs, where
        self.values: list[RewardValue] = []
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

    def score(self, inputs: Sequence[Any], where: Callable[[int], str]) -> list[RewardValue]:
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


def score_on_writer(ranks: Ranks, calls: RewardCalls, inputs: Sequence[Any],
                    where: Callable[[int], str]) -> list[RewardValue]:
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


def keep_components(values: Sequence[RewardValue], samples: Sequence[Any], name: str) -> list[float]:
    """The samples' scalar rewards (a dict's plain sum); a dict's components are kept on its
    sample (``extras[REWARD_COMPONENTS]``). ``name``: the reward function, named when the
    samples' component names differ."""
    first = values[0] if values else None
    names = sorted(first) if isinstance(first, dict) else None
    totals = []
    for i, (value, sample) in enumerate(zip(values, samples, strict=True)):
        got = sorted(value) if isinstance(value, dict) else None
        if got != names:
            raise RewardError(f"reward function {name} returned components {got} for sample {i} of the step but "
                              f"{names} for sample 0: every sample needs the same reward components (or none)")
        if isinstance(value, dict):
            sample.extras[REWARD_COMPONENTS] = value
            totals.append(float(sum(value.values())))
        else:
            totals.append(float(value))
    return totals


def reward_components(samples: Sequence[Any]) -> dict[str, torch.Tensor] | None:
    """The step's reward components, ``{name: [N] float}`` in sample order, or None when the
    reward function returned single values. Samples of different scoring rounds (DAPO's dynamic
    sampling) must agree on the names."""
    parts = [s.extras.get(REWARD_COMPONENTS) for s in samples]
    if not parts or parts[0] is None:
        if any(p is not None for p in parts):
            raise RewardError("some samples of the step have reward components and others not")
        return None
    names = sorted(parts[0])
    if any(p is None or sorted(p) != names for p in parts):
        raise RewardError(f"the step's samples have different reward components (sample 0: {names})")
    return {n: torch.tensor([p[n] for p in parts], dtype=torch.float32) for n in names}


def component_means(components: dict[str, torch.Tensor] | None) -> dict[str, float]:
    """``reward/<name>``: each component's mean over the step's samples."""
    return {f"reward/{n}": float(v.mean()) for n, v in (components or {}).items() if v.numel()}
