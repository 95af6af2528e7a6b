"""What the built-in algorithms share: the PPO-clip settings and their check, the outcome
advantage estimators by name, and the builders that pair an estimator with a loss. Torch-free at
import: the builders import the implementations of :mod:`rlcore.algorithms` when called."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlcore.algorithms.spec import Algorithm
from rlcore.errors import ConfigError

#: ``algorithm.advantage`` of the algorithms that take an outcome estimator by name
ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
#: ``algorithm.std``: the group std GRPO's estimator divides by
STD_MODES = ("population", "unbiased", "none")
#: the loss of every ``ppo_clip`` algorithm, for its ``source``
PPO_SOURCE = "PPO-clip (Schulman et al. 2017) with clip-higher (DAPO) and dual-clip (Ye et al. 2020)"


@dataclass
class PPOClipSettings:
    """``clip_low``/``clip_high``: ε of ``clip(r, 1−ε_l, 1+ε_h)``; ``clip_ratio_c``: the
    dual-clip bound for negative advantages (> 1; 0 turns it off)."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    clip_ratio_c: float = 3.0


@dataclass
class GRPOSettings(PPOClipSettings):
    """``std``: the group std GRPO divides by, ``population`` or ``unbiased`` (``none``:
    no division); ``normalize_std: false`` is the older spelling of ``std: none``."""

    std: str = "population"
    normalize_std: bool = True
    eps: float = 1e-6


def bad(key: str, why: str) -> ConfigError:
    return ConfigError(f"bad value for config key 'algorithm.{key}': {why}", key=f"algorithm.{key}")


def check_clip(s: Any, *, ppo_low: bool = True) -> None:
    """The clip bounds every clipped loss shares (``algorithm.clip_low``/``clip_high``/``clip_ratio_c``);
    ``ppo_low``: ``clip_low`` is PPO's ε (the ratio's lower bound ``1 − clip_low`` stays positive)."""
    for key in ("clip_low", "clip_high"):
        if float(s[key]) < 0:
            raise bad(key, "must be >= 0")
    if ppo_low and float(s.clip_low) >= 1:
        raise bad("clip_low", "must be < 1 (the ratio's lower bound 1 - clip_low must stay positive)")
    if "clip_ratio_c" in s and float(s.clip_ratio_c) != 0 and float(s.clip_ratio_c) <= 1:
        raise bad("clip_ratio_c", "must be > 1 (dual-clip bound) or 0 (off)")


def check_choice(s: Any, key: str, choices: tuple[str, ...]) -> None:
    if s[key] not in choices:
        raise bad(key, f"{s[key]!r}; choose one of: {', '.join(choices)}")


def check_estimator(s: Any) -> None:
    """``algorithm.advantage`` and ``algorithm.std`` of an algorithm that takes an estimator by name."""
    check_choice(s, "advantage", ADVANTAGES)
    check_choice(s, "std", STD_MODES)


def check_positive(s: Any, *keys: str) -> None:
    for key in keys:
        if not float(s[key]) > 0:
            raise bad(key, "must be > 0")


def check_grpo(s: Any) -> None:
    check_clip(s)
    check_choice(s, "std", STD_MODES)
    check_positive(s, "eps")


def estimator(name: str, s: Any):
    """The outcome advantage estimator ``name`` (one of :data:`ADVANTAGES`) with the settings ``s``."""
    from rlcore.algorithms import advantages as adv

    if name == "grpo":
        std = s.get("std", "population")
        if not s.get("normalize_std", True):
            std = "none"
        return adv.GRPOAdvantage(std=std, eps=float(s.get("eps", 1e-6)))
    if name == "dr_grpo":
        return adv.DrGRPOAdvantage()
    if name == "rloo":
        return adv.RLOOAdvantage()
    if name == "reinforce_pp":
        return adv.ReinforcePPAdvantage(gamma=float(s.get("gamma", 1.0)))
    if name == "reinforce_pp_baseline":
        return adv.ReinforcePPBaselineAdvantage()
    raise ValueError(f"unknown advantage estimator {name!r}")


def ppo_clip(s: Any):
    from rlcore.algorithms import PPOClip  # the public loss a third-party algorithm can reuse too

    return PPOClip(float(s.clip_low), float(s.clip_high), float(s.clip_ratio_c))


def with_estimator(loss: Callable[[Any], Any], advantage: str | None = None) -> Callable[[Any], Algorithm]:
    """The factory of an algorithm of ``loss(settings)`` and the estimator ``advantage`` (None: the
    one ``settings.advantage`` names). REINFORCE++'s estimators take per-token rewards."""
    def build(s: Any) -> Algorithm:
        name = advantage or s.advantage
        return Algorithm(advantages=estimator(name, s), loss=loss(s), token_level_rewards=name.startswith("reinforce_pp"))
    return build
