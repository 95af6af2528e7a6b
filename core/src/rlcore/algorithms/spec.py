"""The algorithm contract, kept importable under its first name: the definitions live in
:mod:`rlcore.types.algorithms` (the contracts layer, so that ``rlcore.types`` can hand them on
without an upward import); plugins take them from :mod:`rlcore.types` or :mod:`rlcore.algorithms`."""

from rlcore.types.algorithms import (
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    AdvantageEstimator,
    AdvantageInput,
    Algorithm,
    AlgorithmSpec,
    PolicyLoss,
    TokenInputs,
    TokenLoss,
)

__all__ = [
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "AdvantageEstimator",
    "AdvantageInput",
    "Algorithm",
    "AlgorithmSpec",
    "PolicyLoss",
    "TokenInputs",
    "TokenLoss",
]
