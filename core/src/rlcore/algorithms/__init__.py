"""Algorithms as plugins: the contract (:mod:`.spec`, imported here, torch-free; also in
:mod:`rlcore.types`) and the built-in advantage estimators (:mod:`.advantages`, :mod:`.baselines`), policy
losses (:mod:`.losses`, :mod:`.surrogates`), aggregations (:mod:`.aggregation`) and rollout–trainer mismatch correction
(:mod:`.mismatch`). docs/algorithms.md lists each with its formula and source.

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
    "GSPO": "losses",
    "CISPO": "losses",
    "TokenObjective": "losses",
    "kl_penalty": "losses",
    "GRPOAdvantage": "advantages",
    "DrGRPOAdvantage": "advantages",
    "RLOOAdvantage": "advantages",
    "ReinforcePPAdvantage": "advantages",
    "ReinforcePPBaselineAdvantage": "advantages",
    "group_normalised": "advantages",
    "SAPO": "surrogates",
    "GPG": "surrogates",
    "ClipCov": "surrogates",
    "KLCov": "surrogates",
    "GMPO": "surrogates",
    "DPPO": "surrogates",
    "DRO": "surrogates",
    "OPOAdvantage": "baselines",
    "PassKAdvantage": "baselines",
    "GPGAdvantage": "baselines",
    "ReMaxAdvantage": "remax",
    "OptimalTokenBaselineAdvantage": "token_baseline",
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
