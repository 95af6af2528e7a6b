"""The ``algorithms`` plugin: registers rlcore-algorithms' specs through rlcore's ``algorithm``
hook, as core registers its built-ins (typed :class:`rlcore.algorithms.AlgorithmSpec`\\ s, each
with its settings dataclass and its check). Cheap to import: the factories import torch and the
implementations when they build."""

from __future__ import annotations

from rlcore import PLUGIN_API, hookimpl

from rlcore_algorithms import outcome, policy_losses

__all__ = ["PLUGIN_API", "algorithm"]


@hookimpl
def algorithm():
    yield from outcome.SPECS
    yield from policy_losses.SPECS
