"""``algorithm.dapo``: DAPO's dynamic sampling and overlong shaping (Yu et al. 2025, "DAPO: An
Open-Source LLM Reinforcement Learning System at Scale", arXiv:2503.14476, §3.2 and §3.4), the
settings and their config checks, kept apart from :mod:`rlcore.config` as
:mod:`rlcore.rollout_settings` is. Torch-free; each check names the key it refuses. What the
settings do is in :mod:`rlcore.sampling_rounds` and docs/algorithms.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlcore.errors import ConfigError

#: the largest penalty factor: the largest float32 (as rlcore.guards.REWARD_LIMIT, kept here torch-free)
PENALTY_LIMIT = 3.4028234663852886e38

#: ``algorithm.dapo.dynamic_sampling.metric``: the per-sample value whose equality within a group
#: drops the group: the reward function's value (DAPO's accuracy for a 0/1 reward), or the reward
#: after the soft overlong penalty (what the advantage estimator sees)
FILTER_METRICS = ("reward", "shaped_reward")
#: ``algorithm.dapo.dynamic_sampling.on_max_rounds``: what a step does when ``max_rounds`` rounds kept
#: fewer than ``data.prompts_per_step`` groups: train on the groups kept, or stop the run
ON_MAX_ROUNDS = ("train", "stop")
#: the most rounds a step may take; each round's sampling seed is the step's plus
#: ``round * 2**53`` (rlcore.sampling_rounds), which stays below 2**63 up to here
MAX_ROUNDS_LIMIT = 256


@dataclass
class DynamicSamplingConfig:
    """``enable``: drop every group (the ``rollout.n`` samples of one prompt) whose ``metric`` is
    the same for all its samples, and generate more rounds of prompts until
    ``data.prompts_per_step`` groups are kept. ``prompts_per_round``: prompts generated per
    round (0: ``data.prompts_per_step``). ``max_rounds``: the cap on rounds per step.
    ``on_max_rounds``: ``train`` (on the groups kept, fewer than asked) or ``stop``."""

    enable: bool = False
    metric: str = "reward"
    prompts_per_round: int = 0
    max_rounds: int = 10
    on_max_rounds: str = "train"


@dataclass
class OverlongConfig:
    """``filter``: mask samples the rollout cut at ``rollout.max_new_tokens`` (finish reason
    ``length``) out of the loss. ``buffer_tokens`` > 0: soft overlong punishment, a penalty added
    to the reward, 0 up to ``max_new_tokens - buffer_tokens`` response tokens, falling linearly to
    ``-penalty_factor`` at ``max_new_tokens``."""

    filter: bool = False
    buffer_tokens: int = 0
    penalty_factor: float = 1.0


@dataclass
class DapoConfig:
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)


def _bad(key: str, message: str) -> ConfigError:
    return ConfigError(f"bad value for config key 'algorithm.dapo.{key}': {message}", key=f"algorithm.dapo.{key}")


def check_dapo(cfg: Any) -> None:
    """Refuse ``algorithm.dapo`` settings that cannot hold (with the rest of the config)."""
    ds, ov = cfg.algorithm.dapo.dynamic_sampling, cfg.algorithm.dapo.overlong
    if ds.metric not in FILTER_METRICS:
        raise _bad("dynamic_sampling.metric", f"{ds.metric!r}; choose one of: {', '.join(FILTER_METRICS)}")
    if ds.on_max_rounds not in ON_MAX_ROUNDS:
        raise _bad("dynamic_sampling.on_max_rounds",
                   f"{ds.on_max_rounds!r}; choose one of: {', '.join(ON_MAX_ROUNDS)}")
    if not 1 <= ds.max_rounds <= MAX_ROUNDS_LIMIT:
        raise _bad("dynamic_sampling.max_rounds", f"{ds.max_rounds}; must be in [1, {MAX_ROUNDS_LIMIT}]")
    if ds.prompts_per_round < 0:
        raise _bad("dynamic_sampling.prompts_per_round", f"{ds.prompts_per_round}; must be >= 0 (0: "
                   f"data.prompts_per_step)")
    if ds.enable and cfg.rollout.n < 2:
        raise _bad("dynamic_sampling.enable", f"true needs rollout.n >= 2 (rollout.n={cfg.rollout.n}): a group of "
                   f"one sample always has equal rewards, so every group would be dropped")
    if ds.enable and ds.metric == "shaped_reward" and not ov.buffer_tokens:
        raise _bad("dynamic_sampling.metric", "'shaped_reward' is the reward plus the soft overlong penalty, which "
                   "is off (algorithm.dapo.overlong.buffer_tokens=0): use 'reward', or set buffer_tokens")
    if not 0 <= ov.buffer_tokens <= cfg.rollout.max_new_tokens:
        raise _bad("overlong.buffer_tokens", f"{ov.buffer_tokens}; must be in [0, rollout.max_new_tokens="
                   f"{cfg.rollout.max_new_tokens}] (0: no soft overlong punishment)")
    if not 0 <= ov.penalty_factor <= PENALTY_LIMIT:
        raise _bad("overlong.penalty_factor", f"{ov.penalty_factor!r}; must be in [0, {PENALTY_LIMIT:.7g}]")
