"""The ``loop:`` section: how generation and training overlap (issue 28; docs/async.md). Kept
apart from :mod:`rlcore.config` as :mod:`rlcore.rollout_settings` is; :func:`check_loop` names
the key it refuses.

``mode``:

* ``sync``: generate, train, push: every sample comes from the weights being trained.
* ``one_step_off``: a rollout producer (:mod:`rlcore.rollout_producer`) generates step ``n+1``
  while the trainer trains step ``n``: samples are at most one weight version old.
* ``async``: the producer runs up to ``ahead_steps`` (default ``max_staleness``) steps ahead;
  a sample whose oldest token came from a version more than ``max_staleness`` behind the weights
  that train on it is ``stale`` (``drop``: its prompt's whole group leaves the step;
  ``rescore``: its behaviour log-probs are replaced by the trainer's recomputed ones, so the
  importance weights treat it as on-policy).

Staleness, precisely: the trainer's weight version when it trains the sample (the policy the
step's update starts from) minus the version of the sample's oldest token. A step the producer
starts ``k`` steps ahead is generated on weights at least ``k`` versions behind the ones that
train it (one version per trained step), so it is exactly as stale as ``k`` when the producer
keeps up; no later push can make it fresher (its oldest token stays). Hence with ``stale: drop``
the producer never starts more than ``max_staleness`` steps ahead (a step started further ahead
would be dropped whole: :func:`ahead_steps` caps it and :func:`loop_note` says so in the run
report); only ``stale: rescore`` uses an ``ahead_steps`` above ``max_staleness``, training what
it generates that far ahead past the bound, re-scored.

``in_flight``: what a push does to generation requests in flight. ``abort``: they stop at the
next token and resume on the new weights from where they stopped (each token keeps the
log-prob of the version that produced it, ``Sample.weight_versions`` records the spans);
``keep``: they finish on the old weights and the push waits for them.

``timeouts``: every wait of the overlapped loop, in seconds (each a named error when it runs
out: :class:`rlcore.errors.LoopStallError`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlcore.errors import ConfigError

LOOP_MODES = ("sync", "one_step_off", "async")
STALE_POLICIES = ("drop", "rescore")
IN_FLIGHT_POLICIES = ("abort", "keep")


@dataclass
class LoopTimeouts:
    """Seconds each party of the overlapped loop may keep the other waiting."""

    #: the trainer waits for a step's samples (covers generating and scoring one step)
    samples_s: float = 600.0
    #: the producer waits for the trainer: to take a finished step, or to push the version it needs
    trainer_s: float = 1800.0
    #: a push waits for the producer to stop starting requests and for requests it keeps to finish
    push_s: float = 600.0
    #: the trainer waits for the producer thread to end (a stop, an error, the end of the run)
    join_s: float = 60.0


@dataclass
class LoopConfig:
    """How a step's generation relates to the training of earlier steps (see the module docstring)."""

    mode: str = "sync"
    #: async: the most weight versions a trained-on token may lag the weights it trains
    max_staleness: int = 1
    #: async: how many steps the producer may run ahead of training (None: ``max_staleness``; with
    #: ``stale: drop`` never more than ``max_staleness``, see :func:`ahead_steps`)
    ahead_steps: int | None = None
    #: async: what happens to a sample older than ``max_staleness``
    stale: str = "drop"
    #: what a push does to requests in flight
    in_flight: str = "abort"
    timeouts: LoopTimeouts = field(default_factory=LoopTimeouts)


def configured_ahead(loop: Any) -> int:
    """The steps ahead ``loop:`` asks for (0: sync, 1: one_step_off, async: ``ahead_steps``, unset:
    ``max_staleness``)."""
    if loop.mode == "sync":
        return 0
    if loop.mode == "one_step_off":
        return 1
    return int(loop.max_staleness if loop.ahead_steps is None else loop.ahead_steps)


def ahead_steps(loop: Any) -> int:
    """How many steps ahead of the step being trained the producer may start generating (0:
    sync). With ``stale: drop`` at most ``max_staleness``: every sample of a step started further
    ahead would be older than the bound when trained, so the step would be dropped whole (the
    module docstring; the run report says so, :func:`loop_note`)."""
    asked = configured_ahead(loop)
    return asked if loop.mode != "async" or loop.stale == "rescore" else min(asked, int(loop.max_staleness))


def loop_note(loop: Any) -> str | None:
    """The run report's note when ``loop.ahead_steps`` exceeds ``loop.max_staleness`` (None otherwise)."""
    asked, bound = configured_ahead(loop), max_staleness(loop)
    if asked <= bound:
        return None
    if loop.stale == "drop":
        return (f"loop.ahead_steps={asked} runs as {bound} with loop.stale=drop: a step generated more than "
                f"loop.max_staleness={bound} step(s) ahead would train {asked} versions behind and be dropped whole "
                f"(raise loop.max_staleness to {asked}, or set loop.stale=rescore to train such samples re-scored)")
    return (f"loop.ahead_steps={asked} > loop.max_staleness={bound} with loop.stale=rescore: samples generated more "
            f"than {bound} step(s) ahead train up to {asked} versions behind, with the trainer's log-probs as their "
            f"behaviour log-probs (counted in loop/stale_samples)")


def max_staleness(loop: Any) -> int:
    """The staleness a trained-on sample may have (one_step_off: 1, sync: 0)."""
    return {"sync": 0, "one_step_off": 1}.get(loop.mode, int(loop.max_staleness))


def _refuse(key: str, value: Any, why: str) -> None:
    raise ConfigError(f"bad value for config key '{key}': {value!r}; {why}", key=key)


def check_loop(cfg: Any) -> None:
    """Refuse ``loop:`` settings that cannot hold."""
    loop = cfg.loop
    for key, value, choices in (("loop.mode", loop.mode, LOOP_MODES), ("loop.stale", loop.stale, STALE_POLICIES),
                                ("loop.in_flight", loop.in_flight, IN_FLIGHT_POLICIES)):
        if value not in choices:
            _refuse(key, value, f"choose one of: {', '.join(choices)}")
    for key in ("max_staleness", "ahead_steps"):
        value = loop[key]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            _refuse(f"loop.{key}", value, "must be an integer >= 0 (weight versions)")
    if loop.ahead_steps is not None and loop.mode != "async":
        _refuse("loop.ahead_steps", loop.ahead_steps, f"only loop.mode=async runs ahead by a setting "
                f"(loop.mode={loop.mode} runs {ahead_steps(loop)} step(s) ahead)")
    if loop.ahead_steps is not None and loop.ahead_steps < loop.max_staleness:
        _refuse("loop.ahead_steps", loop.ahead_steps, f"below loop.max_staleness={loop.max_staleness}: samples "
                f"could never be as stale as allowed; leave it unset (= max_staleness)")
    for name in ("samples_s", "trainer_s", "push_s", "join_s"):
        value = loop.timeouts[name]
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
            _refuse(f"loop.timeouts.{name}", value, "must be a finite number of seconds > 0 (every wait has a limit)")
