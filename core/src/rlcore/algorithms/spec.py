"""The algorithm contract, kept importable under its first name: the definitions live in
:mod:`rlcore.types.algorithms` (the contracts layer, so that ``rlcore.types`` can hand them on
without an upward import); plugins take them from :mod:`rlcore.types` or :mod:`rlcore.algorithms`."""

from rlcore.types.algorithms import (
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
    "LOSS_AGGREGATIONS",
    "AdvantageEstimator",
    "AdvantageInput",
    "Algorithm",
    "AlgorithmSpec",
    "PolicyLoss",
    "TokenInputs",
    "TokenLoss",
]
