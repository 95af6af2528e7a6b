"""Where a step's samples come from: generated in the step (``loop.mode: sync``) or by a rollout
producer thread that runs ahead of training (``one_step_off``, ``async``; settings and their
meaning: :mod:`rlcore.loop_settings`, docs/async.md).

The producer generates (and scores) steps in order, the same prompts and sampling seeds as the
synchronous loop uses for each step (they derive from the step, not from when it is generated).
It may start step ``s`` once the trainer has finished step ``s - ahead - 1``
(:func:`rlcore.loop_settings.ahead_steps`), i.e. once the push of the version ``ahead`` below the
one that trains step ``s`` has landed: so no sample of step ``s`` is more than ``ahead`` versions
stale, and with ``stale: drop`` ``ahead`` never exceeds ``max_staleness``. With ``ahead = 0``
that is the synchronous loop, run on another thread. The trainer takes a step's samples
(:meth:`RolloutProducer.take`), trains, and pushes inside :meth:`RolloutProducer.pushing`, which
stops the producer from starting a ``generate`` call while the push runs. Requests already in
flight either finish on the old weights first (``loop.in_flight: keep``, and always for a backend
whose ``resumes_in_flight()`` is not True) or meet the push at their next token and resume on the
new weights (``abort``; the backend records each token's version in ``Sample.weight_versions``).

Every wait is bounded by a ``loop.timeouts`` key and ends in :class:`LoopStallError` naming the
party that did not answer and what it was doing. An error in the producer thread stops it and is
raised again in the trainer when it next takes samples (the same exception, with a note saying
which step the producer was generating). :meth:`close` stops and joins the thread on every way
out of the run; samples generated ahead of a checkpoint are not saved: a resumed run generates
them again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch

from rlcore.errors import LoopStallError, RolloutError
from rlcore.faults import fault_point
from rlcore.loop_settings import ahead_steps, max_staleness
from rlcore.types import Sample

#: how often a waiting party wakes to look for a stop or an error in the other party
POLL_S = 0.2


@dataclass
class ProducedStep:
    """A step's samples (:class:`rlcore.sampling_rounds.SampledStep`) with the weight version the
    backend held when their generation started and the seconds the producer waited for the
    trainer before starting it."""

    step: int
    sampled: Any
    start_version: int
    producer_wait_s: float = 0.0


def oldest_version(sample: Sample) -> int:
    """The version of a sample's oldest token (the first span when weights changed mid-sample)."""
    spans = sample.weight_versions
    return min(v for v, _ in spans) if spans else int(sample.weight_version)


def staleness(samples: list[Sample], version: int) -> list[int]:
    """How many versions each sample's oldest token lags ``version`` (the weights training on it)."""
    return [version - oldest_version(s) for s in samples]


def apply_staleness(samples: list[Sample], rewards: list[float], version: int, loop: Any, step: int,
                    start_version: int | None = None
                    ) -> tuple[list[Sample], list[float], torch.Tensor, dict[str, float]]:
    """Staleness metrics and ``loop.stale``: ``drop`` removes every group (the samples of one
    prompt, which share a baseline) holding a sample older than the allowed staleness (the kept
    groups renumbered in order); ``rescore`` keeps them and returns the mask of samples whose
    behaviour log-probs the trainer replaces with its recomputed ones. ``loop/staleness_mean`` and
    ``loop/staleness_max`` are those of the samples the step trains (after a drop);
    ``loop/stale_samples`` counts the samples over the bound (dropped or re-scored).
    ``start_version``: the weights the producer started the step on (for the error)."""
    lag = staleness(samples, version)
    limit = max_staleness(loop)
    stale = [x > limit for x in lag]
    metrics = {"loop/stale_samples": float(sum(stale)), "loop/dropped_samples": 0.0,
               "loop/resumed_samples": float(sum(len(s.weight_versions or ()) > 1 for s in samples))}
    rescore = torch.zeros(len(samples), dtype=torch.bool)
    kept, kept_rewards, kept_lag = samples, rewards, lag
    if any(stale) and loop.stale == "rescore":
        rescore = torch.tensor(stale)
    elif any(stale):
        bad = {s.prompt_index for s, old in zip(samples, stale, strict=True) if old}
        renumber: dict[int, int] = {}
        kept, kept_rewards, kept_lag = [], [], []
        for s, r, x in zip(samples, rewards, lag, strict=True):
            if s.prompt_index not in bad:
                kept.append(replace(s, prompt_index=renumber.setdefault(s.prompt_index, len(renumber))))
                kept_rewards.append(r)
                kept_lag.append(x)
        if not kept:
            started = "" if start_version is None else f", and the rollout producer started it on version {start_version}"
            raise RolloutError(f"every sample of step {step} is more than loop.max_staleness={limit} weight versions "
                               f"behind version {version} (staleness up to {max(lag)}{started}), so loop.stale=drop "
                               f"leaves nothing to train on: raise loop.max_staleness, or set loop.stale=rescore")
        metrics["loop/dropped_samples"] = float(len(samples) - len(kept))
        rescore = torch.zeros(len(kept), dtype=torch.bool)
    metrics["loop/staleness_mean"] = sum(kept_lag) / max(len(kept_lag), 1)
    metrics["loop/staleness_max"] = float(max(kept_lag, default=0))
    return kept, kept_rewards, rescore, metrics


class SyncSource:
    """``loop.mode: sync``: the step's samples are generated when the trainer asks for them."""

    def __init__(self, produce: Callable[[int, Any], Any], backend: Any):
        self._produce, self._backend = produce, backend

    def start(self, first_step: int, version: int) -> None:
        pass

    def take(self, step: int) -> tuple[ProducedStep, dict[str, float]]:
        version = self._backend.weight_version
        return ProducedStep(step, self._produce(step, self._backend), version), {}

    @contextmanager
    def pushing(self, version: int) -> Iterator[dict[str, float]]:
        yield {}

    def finished(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class _GatedBackend:
    """The backend as the producer thread sees it: ``generate`` waits while a push runs (a push
    pauses the backend) and is counted while in flight, so a push can wait for it."""

    def __init__(self, producer: RolloutProducer):
        self._p = producer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._p.backend, name)

    def generate(self, prompts: Any, params: Any) -> list[Sample]:
        p = self._p
        with p.cond:
            p.wait_for(lambda: not p.push_running, p.timeouts.push_s, "loop.timeouts.push_s",
                       lambda: f"the rollout producer waited to generate step {p.current_step} while the trainer "
                               f"pushed weight version {p.push_version}, and the push did not end")
            p.in_flight += 1
        try:
            out = p.backend.generate(prompts, params)
            fault_point("producer")  # step s's requests done, before the producer hands them over
            return out
        finally:
            with p.cond:
                p.in_flight -= 1
                p.cond.notify_all()


class RolloutProducer:
    """The rollout producer thread (see the module docstring). ``produce(step, backend)`` returns
    the step's :class:`~rlcore.sampling_rounds.SampledStep`; ``last_step`` is exclusive."""

    def __init__(self, produce: Callable[[int, Any], Any], backend: Any, loop: Any, last_step: int):
        self.produce, self.backend, self.loop, self.last_step = produce, backend, loop, int(last_step)
        self.timeouts = loop.timeouts
        self.ahead = ahead_steps(loop)
        #: a push lands while requests are in flight only if the backend resumes them on the new weights
        #: (asked in start(): a backend knows once it runs)
        self.abort_in_flight = False
        self.cond = threading.Condition()
        self.ready: dict[int, ProducedStep] = {}
        self.error: BaseException | None = None
        self.stopping = False
        self.push_running = False
        self.push_version: int | None = None
        self.in_flight = 0
        self.next_to_train = 0  # the trainer has finished every step before it
        self.current_step: int | None = None
        self.thread: threading.Thread | None = None

    # ------------------------------------------------------------- shared waiting ---------

    def wait_for(self, ready: Callable[[], bool], limit_s: float, key: str, what: Callable[[], str]) -> float:
        """Wait (holding ``cond``) until ``ready()``; the seconds waited. A stop ends it with
        :class:`_Stopped`; ``limit_s`` running out, with :class:`LoopStallError`."""
        t0 = time.monotonic()
        while not ready():
            if self.stopping:
                raise _Stopped()
            if self.error is not None and threading.current_thread() is not self.thread:
                raise self.error
            left = limit_s - (time.monotonic() - t0)
            if left <= 0:
                raise LoopStallError(f"{what()} within {key}={limit_s:g} s")
            self.cond.wait(min(POLL_S, left))
        return time.monotonic() - t0

    # ------------------------------------------------------------- trainer side -----------

    def start(self, first_step: int, version: int) -> None:
        self.next_to_train = int(first_step)
        self.abort_in_flight = self.loop.in_flight == "abort" and _resumes_in_flight(self.backend)
        self.thread = threading.Thread(target=self._run, args=(int(first_step),), name="rlcore-rollout-producer",
                                       daemon=True)  # a thread that ignores a stop must not keep the process
        self.thread.start()

    def take(self, step: int) -> tuple[ProducedStep, dict[str, float]]:
        """Step ``step``'s samples, once produced; re-raises the producer's error."""
        with self.cond:
            waited = self.wait_for(
                lambda: step in self.ready or self.error is not None, self.timeouts.samples_s,
                "loop.timeouts.samples_s",
                lambda: f"the trainer waited for step {step}'s samples, and the rollout producer (generating step "
                        f"{self.current_step}, {self.in_flight} generate call(s) in flight) did not deliver them")
            if step not in self.ready:
                raise self.error
            produced = self.ready.pop(step)
        return produced, {"loop/trainer_wait_s": waited, "loop/producer_wait_s": produced.producer_wait_s,
                          "loop/queued_steps": float(len(self.ready))}

    @contextmanager
    def pushing(self, version: int) -> Iterator[dict[str, float]]:
        """Around a push of ``version``: no ``generate`` starts; requests in flight finish first
        unless the backend resumes them on the new weights (``loop.in_flight: abort``)."""
        metrics: dict[str, float] = {}
        with self.cond:
            self.push_running, self.push_version = True, version
            metrics["loop/push_in_flight"] = float(self.in_flight)
            if not self.abort_in_flight:
                metrics["loop/push_wait_s"] = self.wait_for(
                    lambda: self.in_flight == 0, self.timeouts.push_s, "loop.timeouts.push_s",
                    lambda: f"the push of weight version {version} waited for the rollout's {self.in_flight} "
                            f"generate call(s) in flight (step {self.current_step}, loop.in_flight=keep) to finish, "
                            f"and they did not")
        try:
            if metrics["loop/push_in_flight"]:
                fault_point("push_in_flight")  # a push starts while requests are in flight
            yield metrics
        finally:
            with self.cond:
                self.push_running = False
                self.cond.notify_all()

    def finished(self, step: int) -> None:
        """The trainer is done with ``step`` (trained and pushed, or skipped)."""
        with self.cond:
            self.next_to_train = step + 1
            self.cond.notify_all()

    def close(self) -> None:
        """Stop the producer and join it (at most ``loop.timeouts.join_s``)."""
        if self.thread is None:
            return
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self.thread.join(self.timeouts.join_s)
        if self.thread.is_alive():
            raise LoopStallError(
                f"the rollout producer did not stop within loop.timeouts.join_s={self.timeouts.join_s:g} s "
                f"(generating step {self.current_step}, {self.in_flight} generate call(s) in flight); the rollout "
                f"backend did not return from generate")
        self.thread = None

    # ------------------------------------------------------------- producer thread -----------

    def _run(self, first_step: int) -> None:
        gated = _GatedBackend(self)
        try:
            for step in range(first_step, self.last_step):
                with self.cond:  # may start once the trainer finished step - ahead - 1
                    waited = self.wait_for(
                        lambda s=step: self.next_to_train >= s - self.ahead, self.timeouts.trainer_s,
                        "loop.timeouts.trainer_s",
                        lambda s=step: f"the rollout producer waited to generate step {s} for the trainer to finish "
                                       f"step {s - self.ahead - 1}, and it did not")
                    self.current_step = step
                    version = self.backend.weight_version
                sampled = self.produce(step, gated)
                with self.cond:
                    self.ready[step] = ProducedStep(step, sampled, version, waited)
                    self.current_step = None
                    self.cond.notify_all()
        except _Stopped:
            pass
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer, raised there
            if hasattr(exc, "add_note"):
                exc.add_note(f"(raised in the rollout producer thread, generating step {self.current_step})")
            with self.cond:
                self.error = exc
                self.cond.notify_all()


class _Stopped(Exception):
    """The producer was asked to stop while it waited."""


def _resumes_in_flight(backend: Any) -> bool:
    resumes = getattr(backend, "resumes_in_flight", None)
    return bool(resumes()) if callable(resumes) else False


def step_source(loop: Any, produce: Callable[[int, Any], Any], backend: Any, last_step: int) -> Any:
    """The synchronous source or a producer, as ``loop.mode`` says."""
    if loop.mode == "sync":
        return SyncSource(produce, backend)
    return RolloutProducer(produce, backend, loop, last_step)
