"""Core's settings of the ``algorithm:`` section that every algorithm shares, beside the selected
algorithm's own (rlcore.builtin.algorithms for the built-ins), and their config checks, which
:mod:`rlcore.config` calls: the adaptive KL controller, the rollout–trainer mismatch correction
(truncated importance weights, masks, and the rejection of whole sequences by a mismatch statistic)
and DAPO's dynamic sampling and overlong shaping (Yu et al. 2025, "DAPO: An Open-Source LLM
Reinforcement Learning System at Scale", arXiv:2503.14476, §3.2 and §3.4; what they do is in
:mod:`rlcore.sampling_rounds`). Torch-free; each check names the key it refuses. The formulas are
in docs/algorithms.md."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlcore.errors import ConfigError

#: ``algorithm.mismatch.reject``: a per-sequence statistic of the per-token k1/k2/k3 of
#: KL(rollout‖trainer) (sum, mean or max over the sequence's loss tokens); a sequence whose
#: statistic exceeds ``reject_max`` (k1: whose absolute value does) gets weight 0
REJECT_STATS = ("seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
                "seq_max_k2", "seq_max_k3")


@dataclass
class MismatchConfig:
    """Rollout–trainer mismatch correction (docs/algorithms.md). ``level``: ``token``,
    ``sequence`` (product of the token ratios) or ``geometric`` (their geometric mean);
    ``tis_cap`` > 0: truncated importance weights ``min(ρ, tis_cap)``; ``mask_low`` /
    ``mask_high`` > 0: tokens (or sequences) whose ratio is below / above get weight 0. All 0:
    no correction (the metrics ``mismatch/*`` are reported every step anyway)."""

    level: str = "token"
    tis_cap: float = 0.0
    mask_low: float = 0.0
    mask_high: float = 0.0
    reject: str = ""  #: reject whole sequences by a mismatch statistic (:data:`REJECT_STATS`)
    reject_max: float = 0.0


@dataclass
class KLControlConfig:
    """``algorithm.kl_control``: ``target`` > 0 adapts β (``algorithm.kl_coef`` its start) after
    every step towards a per-token KL of ``target`` (rlcore.algorithms.kl_control); ``horizon``:
    how slowly (verl's default 10000). 0: β fixed."""

    target: float = 0.0
    horizon: int = 10000


def check_modifiers(cfg: Any) -> bool:
    """Check the ``algorithm:`` section's modifiers (KL control, mismatch correction, DAPO); True
    when a mismatch correction is on (:func:`check_mismatch`)."""
    check_kl_control(cfg.algorithm)
    check_dapo(cfg)
    return check_mismatch(cfg.algorithm.mismatch)


def check_kl_control(a: Any) -> None:
    kc = a.kl_control
    if kc.target < 0:
        raise ConfigError("bad value for config key 'algorithm.kl_control.target': must be >= 0 (0 = fixed kl_coef)",
                          key="algorithm.kl_control.target")
    if kc.horizon < 1:
        raise ConfigError("bad value for config key 'algorithm.kl_control.horizon': must be >= 1",
                          key="algorithm.kl_control.horizon")
    if kc.target > 0 and not a.kl_coef > 0:
        raise ConfigError("algorithm.kl_control.target adapts algorithm.kl_coef, which is 0 (no KL term): set "
                          "algorithm.kl_coef > 0 (the starting coefficient) or kl_control.target=0",
                          key="algorithm.kl_control.target")


def check_mismatch(mm: Any) -> bool:
    """Refuse a bad ``algorithm.mismatch`` setting; True when any correction is on (TIS, masks
    or rejection: the PPO ratio is then taken against the trainer's recomputed log-probs)."""
    for key in ("tis_cap", "mask_low", "mask_high"):
        if mm[key] < 0:
            raise ConfigError(f"bad value for config key 'algorithm.mismatch.{key}': must be >= 0 (0 = off)",
                              key=f"algorithm.mismatch.{key}")
    if mm.mask_high and mm.mask_low and mm.mask_low >= mm.mask_high:
        raise ConfigError("bad value for config key 'algorithm.mismatch.mask_low': must be below mask_high",
                          key="algorithm.mismatch.mask_low")
    if mm.tis_cap and mm.tis_cap < 1:
        raise ConfigError("bad value for config key 'algorithm.mismatch.tis_cap': must be >= 1 (weights are "
                          "truncated at it) or 0 (off)", key="algorithm.mismatch.tis_cap")
    if mm.reject and mm.reject not in REJECT_STATS:
        raise ConfigError(f"bad value for config key 'algorithm.mismatch.reject': {mm.reject!r}; choose one of: "
                          f"{', '.join(REJECT_STATS)} (or leave it empty: off)", key="algorithm.mismatch.reject")
    if mm.reject and not mm.reject_max > 0:
        raise ConfigError(f"algorithm.mismatch.reject={mm.reject} needs algorithm.mismatch.reject_max > 0 (the "
                          f"largest statistic a kept sequence may have)", key="algorithm.mismatch.reject_max")
    if not mm.reject and mm.reject_max:
        raise ConfigError("algorithm.mismatch.reject_max is set but algorithm.mismatch.reject (the statistic it "
                          "bounds) is empty", key="algorithm.mismatch.reject_max")
    return bool(mm.tis_cap or mm.mask_low or mm.mask_high or mm.reject)


# ---------------------------------------------------------------------------------- DAPO --

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
