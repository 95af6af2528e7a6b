"""Config checks of core's algorithm modifiers that :mod:`rlcore.config` delegates (kept apart from
it as :mod:`rlcore.rollout_settings` is): the adaptive KL controller and the rollout–trainer
mismatch correction (truncated importance weights, masks, and the rejection of whole sequences
by a mismatch statistic). Torch-free; each check names the key it refuses. The formulas are in
docs/algorithms.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlcore.errors import ConfigError

#: ``algorithm.mismatch.reject``: a per-sequence statistic of the per-token k1/k2/k3 of
#: KL(rollout‖trainer) (sum, mean or max over the sequence's loss tokens); a sequence whose
#: statistic exceeds ``reject_max`` (k1: whose absolute value does) gets weight 0
REJECT_STATS = ("seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
                "seq_max_k2", "seq_max_k3")


@dataclass
class KLControlConfig:
    """``algorithm.kl_control``: ``target`` > 0 adapts β (``algorithm.kl_coef`` its start) after
    every step towards a per-token KL of ``target`` (rlcore.algorithms.kl_control); ``horizon``:
    how slowly (verl's default 10000). 0: β fixed."""

    target: float = 0.0
    horizon: int = 10000


def check_modifiers(a: Any) -> bool:
    """Check the ``algorithm:`` section's modifiers (KL control, mismatch correction); True when
    a mismatch correction is on (:func:`check_mismatch`)."""
    check_kl_control(a)
    return check_mismatch(a.mismatch)


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

