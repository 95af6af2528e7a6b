"""What the PPO-clip algorithms share, core's built-ins and rlcore-algorithms' alike: the PPO-clip
settings and their check, core's outcome advantage estimators by name, and the builders that pair
an estimator with a loss. Public through :mod:`rlcore.algorithms` (``PPOClipSettings``,
``check_clip``, ``with_estimator`` ...). Torch-free at import: the builders import the
implementations of :mod:`rlcore.algorithms` when called."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from rlcore.algorithms.spec import Algorithm
from rlcore.errors import ConfigError

#: the outcome estimators :func:`estimator` builds by name
ADVANTAGES = ("grpo", "dr_grpo", "rloo")
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


def bad_value(key: str, why: str) -> ConfigError:
    """The :class:`ConfigError` for a bad value of ``algorithm.<key>``, naming the key."""
    return ConfigError(f"bad value for config key 'algorithm.{key}': {why}", key=f"algorithm.{key}")


def check_clip(s: Any, *, ppo_low: bool = True) -> None:
    """The clip bounds every clipped loss shares (``algorithm.clip_low``/``clip_high``/``clip_ratio_c``);
    ``ppo_low``: ``clip_low`` is PPO's ε (the ratio's lower bound ``1 − clip_low`` stays positive)."""
    for key in ("clip_low", "clip_high"):
        if float(s[key]) < 0:
            raise bad_value(key, "must be >= 0")
    if ppo_low and float(s.clip_low) >= 1:
        raise bad_value("clip_low", "must be < 1 (the ratio's lower bound 1 - clip_low must stay positive)")
    if "clip_ratio_c" in s and float(s.clip_ratio_c) != 0 and float(s.clip_ratio_c) <= 1:
        raise bad_value("clip_ratio_c", "must be > 1 (dual-clip bound) or 0 (off)")


def check_choice(s: Any, key: str, choices: tuple[str, ...]) -> None:
    if s[key] not in choices:
        raise bad_value(key, f"{s[key]!r}; choose one of: {', '.join(choices)}")


def check_positive(s: Any, *keys: str) -> None:
    for key in keys:
        if not float(s[key]) > 0:
            raise bad_value(key, "must be > 0")


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
    raise ValueError(f"unknown advantage estimator {name!r}")


def ppo_clip(s: Any):
    from rlcore.algorithms import PPOClip  # the public loss a third-party algorithm can reuse too

    return PPOClip(float(s.clip_low), float(s.clip_high), float(s.clip_ratio_c))


def with_estimator(loss: Callable[[Any], Any], advantage: str | None = None, *,
                   estimators: Callable[[str, Any], Any] = estimator,
                   token_level: Collection[str] = ()) -> Callable[[Any], Algorithm]:
    """The factory of an algorithm of ``loss(settings)`` and the estimator ``advantage`` (None: the
    one ``settings.advantage`` names), built by ``estimators(name, settings)`` (default: core's,
    :func:`estimator`). The estimators named in ``token_level`` take per-token rewards
    (``Algorithm.token_level_rewards``)."""
    def build(s: Any) -> Algorithm:
        name = advantage or s.advantage
        return Algorithm(advantages=estimators(name, s), loss=loss(s), token_level_rewards=name in token_level)
    return build
