"""Sampling seeds of a rollout backend, the same for every backend.

A backend is built with a base seed (:func:`base_seed`: ``rollout.seed``, or ``training.seed``
when that is unset). Each ``generate`` call samples with the request's own seed when it sets one
(:attr:`~rlcore.types.SamplingSettings.seed`), else with :meth:`CallSeeds.next`'s fresh seed: the
base seed times a large prime plus the number of earlier unseeded calls, so calls differ from one
another and a run with the same base seed repeats them.

The trainer sets the request's seed every step (:func:`step_seed`): the same base seed times the
same prime plus the step, so ``rollout.seed`` is what a run's samples derive from. Left unset it
is ``training.seed`` (one number seeds the whole run); set, it changes the samples and nothing
else (prompts and the model's initialisation stay on ``training.seed``).
"""

from __future__ import annotations

import itertools
from typing import Any

__all__ = ["CallSeeds", "SEED_STRIDE", "base_seed", "copy_seed", "step_seed"]

#: spreads the base seeds of different runs apart (a prime, so nearby bases do not collide early)
SEED_STRIDE = 1_000_003


def copy_seed(call_seed: int, prompt_key: int, copy: int = 0, modulus: int = 1 << 63) -> int:
    """The seed of copy ``copy`` of the prompt keyed ``prompt_key`` (its index) in a call seeded
    ``call_seed``, below ``modulus``: one formula for every backend, so the local rollout and
    rlcore-vllm draw each prompt's copies from seeds of their own."""
    return ((int(call_seed) * SEED_STRIDE + int(prompt_key)) * 1_031 + int(copy)) % modulus


def base_seed(config: Any) -> int:
    """A rollout backend's base seed: ``rollout.seed``, else ``training.seed``."""
    seed = config.rollout.seed
    return int(config.training.seed if seed is None else seed)


def step_seed(config: Any, step: int) -> int:
    """The sampling seed the trainer asks for at ``step``: ``base_seed(config)`` spread by
    :data:`SEED_STRIDE`, plus the step (a resumed run asks for the same seed again)."""
    return base_seed(config) * SEED_STRIDE + int(step)


class CallSeeds:
    """The seed of each ``generate`` call of one backend (see the module docstring)."""

    def __init__(self, base: int):
        self.base = int(base)
        self._unseeded_calls = itertools.count()

    def next(self, requested: int | None) -> int:
        """``requested`` when the call sets a seed, else the next derived seed."""
        if requested is not None:
            return int(requested)
        return self.base * SEED_STRIDE + next(self._unseeded_calls)
