"""Algorithms as plugins: the contract (:mod:`.spec`, imported here, torch-free) and the built-in
advantage estimators (:mod:`.advantages`), policy losses (:mod:`.losses`), aggregations
(:mod:`.aggregation`) and rollout–trainer mismatch correction (:mod:`.mismatch`). docs/algorithms.md
lists each with its formula and source."""

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
