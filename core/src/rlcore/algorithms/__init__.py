"""Algorithms as plugins: the contract (:mod:`.spec`, imported here, torch-free; also in
:mod:`rlcore.types`), core's advantage estimators (:mod:`.advantages`: GRPO, Dr.GRPO, RLOO;
:mod:`.gae` for PPO), its policy loss (:mod:`.losses`: PPO-clip), the PPO-clip algorithms' settings
and builders (:mod:`.common`), aggregations (:mod:`.aggregation`) and rollout–trainer mismatch
correction (:mod:`.mismatch`). The other algorithms are the ``rlcore-algorithms`` plugin's, built
on these. docs/algorithms.md lists each with its formula and source.

The built-in policy losses and estimators are public, so a new algorithm can pair its own
estimator with a built-in loss (or the reverse)::

    from rlcore.algorithms import Algorithm, PPOClip
    Algorithm(advantages=MyEstimator(), loss=PPOClip(clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0))

They need torch, so they are imported on first use (``rlcore.algorithms.PPOClip``), not with this
package: a plugin module that imports ``rlcore.algorithms`` for its ``AlgorithmSpec`` stays cheap.
"""

from __future__ import annotations

from typing import Any

from rlcore.algorithms.spec import (
    LOSS_AGGREGATIONS,
    AdvantageEstimator,
    AdvantageInput,
    Algorithm,
    AlgorithmSpec,
    PolicyLoss,
    TokenInputs,
    TokenLoss,
)

#: the built-in implementations, by the module that defines them (imported on first access)
_IMPLEMENTATIONS = {
    "PPOClip": "losses",
    "TokenObjective": "losses",
    "kl_penalty": "losses",
    "LOG_RATIO_BOUND": "losses",
    "log_ratio": "losses",
    "bounded_log_ratio": "losses",
    "clip_branch": "losses",
    "GRPOAdvantage": "advantages",
    "DrGRPOAdvantage": "advantages",
    "RLOOAdvantage": "advantages",
    "group_normalised": "advantages",
    "broadcast": "advantages",
    # the settings, checks and builders of the PPO-clip algorithms (torch-free)
    "PPOClipSettings": "common",
    "GRPOSettings": "common",
    "STD_MODES": "common",
    "PPO_SOURCE": "common",
    "bad_value": "common",
    "check_clip": "common",
    "check_choice": "common",
    "check_positive": "common",
    "check_grpo": "common",
    "estimator": "common",
    "ppo_clip": "common",
    "with_estimator": "common",
}

__all__ = [
    "LOSS_AGGREGATIONS",
    "AdvantageEstimator",
    "AdvantageInput",
    "Algorithm",
    "AlgorithmSpec",
    "PolicyLoss",
    "TokenInputs",
    "TokenLoss",
    *_IMPLEMENTATIONS,
]


def __getattr__(name: str) -> Any:
    module = _IMPLEMENTATIONS.get(name)
    if module is None:
        raise AttributeError(f"module 'rlcore.algorithms' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"rlcore.algorithms.{module}"), name)
    globals()[name] = value  # later accesses skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_IMPLEMENTATIONS))
