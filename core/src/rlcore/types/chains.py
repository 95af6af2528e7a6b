"""What the ``forward_request``, ``postprocess`` and ``step_end`` chain hooks receive and return.

Import these from :mod:`rlcore.types`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlcore.types.forward import EngineOutput, ForwardFn, HeadOutput, HeadWeight

if TYPE_CHECKING:  # pragma: no cover - annotations only
    from rlcore.batch import PackedBatch


@dataclass
class ForwardRequest:
    """Extra outputs a plugin wants from a micro-batch forward (``forward_request`` hook).

    ``mtp_detach_trunk`` (with ``mtp_hidden``): the engine cuts the MTP layers' inputs from the
    trunk (the trunk hidden state entering depth 1 and the shared embedding lookups), so a loss on
    the MTP hidden states trains the MTP layers only (and the head, unless detached there)."""

    record_routes: bool = False
    mtp_hidden: bool = False
    mtp_detach_trunk: bool = False

    def engine_kwargs(self) -> dict[str, bool]:
        """The MTP keyword arguments of ``TrainingEngine.forward`` (``mtp_detach_trunk`` only when
        MTP hidden states are asked for, so engines without MTP need not know it)."""
        if not self.mtp_hidden:
            return {"mtp_hidden": False}
        return {"mtp_hidden": True, "mtp_detach_trunk": self.mtp_detach_trunk}

    def merge(self, other: ForwardRequest | None) -> ForwardRequest:
        if other is None:
            return self
        return ForwardRequest(
            record_routes=self.record_routes or other.record_routes,
            mtp_hidden=self.mtp_hidden or other.mtp_hidden,
            mtp_detach_trunk=self.mtp_detach_trunk or other.mtp_detach_trunk,
        )


@dataclass
class ModelOutput:
    """What the postprocess chain sees after a micro-batch forward."""

    engine: EngineOutput
    head: HeadOutput
    head_weight: HeadWeight
    forward_fn: ForwardFn


@dataclass
class PostprocessResult:
    """What a postprocess implementation returns.

    ``loss_terms``: scalar tensors added to this micro-batch's loss (already weighted; name
    them, they are logged). ``metrics``: floats averaged over micro-batches and logged.
    ``batch_updates``: per-token tensors ``[T, ...]`` written into the step's batch fields
    under their keys, e.g. routes recorded during ``old_logprob`` for R2 replay.
    """

    loss_terms: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    batch_updates: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepContext:
    """End of a training step (after the optimizer step, before the weight push)."""

    step: int
    batch: PackedBatch
    metrics: dict[str, float]
    config: Any = None
