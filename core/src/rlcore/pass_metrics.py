"""The metrics of one forward pass over micro-batches, each declared by how it reduces.

A pass (old log-probs, reference log-probs, the train pass) runs a rank's micro-batches and
reports numbers from three places: the loss and its terms (summed: the step loss is the sum of
the micro-batches' shares), the policy loss's per-token statistics (summed over tokens, divided
by the pass's loss tokens: :meth:`rlcore.types.PolicyLoss.metrics` says core averages them over
the step's loss tokens) and the postprocess plugins' metrics (averaged over the micro-batches
that reported them: :class:`rlcore.types.PostprocessResult`). :class:`PassMetrics` keeps the
three apart by declaration, so the same reduction holds over micro-batches and over ranks
(:meth:`PassMetrics.combine`, which a data-parallel rank strategy applies to every rank's
metrics); a key is never classified by its name.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import Enum
from typing import Any


class Reduce(Enum):
    #: summed over micro-batches and ranks (the loss, its terms)
    SUM = "sum"
    #: averaged over the micro-batches (of every rank) that reported it
    MEAN = "mean"
    #: summed per token, divided by the loss tokens of the whole pass (of every rank)
    TOKEN_MEAN = "token_mean"


class PassMetrics:
    """Accumulates one pass's metrics; :meth:`result` gives the reduced values."""

    def __init__(self) -> None:
        self._kind: dict[str, Reduce] = {}
        self._total: dict[str, float] = {}
        self._count: dict[str, int] = {}  # micro-batches that reported a MEAN key
        self.loss_tokens = 0.0  # the divisor of the TOKEN_MEAN keys

    def add(self, key: str, value: Any, how: Reduce) -> None:
        """Add one micro-batch's ``value`` (a float or a scalar tensor) to ``key``."""
        known = self._kind.setdefault(key, how)
        if known is not how:
            raise ValueError(f"pass metric {key!r} is reported as a {how.value} and as a {known.value}")
        self._total[key] = self._total.get(key, 0.0) + float(value)
        if how is Reduce.MEAN:
            self._count[key] = self._count.get(key, 0) + 1

    def add_sum(self, key: str, value: Any) -> None:
        self.add(key, value, Reduce.SUM)

    def add_mean(self, key: str, value: Any) -> None:
        self.add(key, value, Reduce.MEAN)

    def add_token_sums(self, sums: Mapping[str, float], loss_tokens: float) -> None:
        """One micro-batch's per-token statistics summed over its ``loss_tokens`` loss tokens."""
        for key, value in sums.items():
            self.add(key, value, Reduce.TOKEN_MEAN)
        self.loss_tokens += float(loss_tokens)

    def __contains__(self, key: str) -> bool:
        return key in self._kind

    def kinds(self) -> dict[str, Reduce]:
        return dict(self._kind)

    @classmethod
    def combine(cls, parts: Iterable[PassMetrics]) -> PassMetrics:
        """The metrics of several ranks' passes as one pass over all their micro-batches (in the
        order given: every rank combines the same list in the same order, so every rank gets
        the same floats)."""
        out = cls()
        for part in parts:
            for key, how in part._kind.items():
                known = out._kind.setdefault(key, how)
                if known is not how:
                    raise ValueError(f"pass metric {key!r} is reported as a {how.value} by one rank and as a "
                                     f"{known.value} by another")
                out._total[key] = out._total.get(key, 0.0) + part._total[key]
                if how is Reduce.MEAN:
                    out._count[key] = out._count.get(key, 0) + part._count[key]
            out.loss_tokens += part.loss_tokens
        return out

    def result(self) -> dict[str, float]:
        tokens = max(self.loss_tokens, 1.0)
        out: dict[str, float] = {}
        for key, how in self._kind.items():
            total = self._total[key]
            if how is Reduce.MEAN:
                out[key] = total / self._count[key]
            elif how is Reduce.TOKEN_MEAN:
                out[key] = total / tokens
            else:
                out[key] = total
        return out
