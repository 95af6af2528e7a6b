"""How the trainer's ranks share a step: the rank strategy :class:`rlcore.trainer.Trainer` takes.

The loop is the same on one process and on many; what differs is decided here:

* which micro-batches this rank runs (:meth:`RankStrategy.micro_batches`),
* how a pass's metrics, the no-grad passes' log-probs and the train pass's gradients reduce over
  the ranks (:meth:`~RankStrategy.reduce_metrics`, :meth:`~RankStrategy.reduce_logprobs`,
  :meth:`~RankStrategy.reduce_gradients`),
* which rank writes (``ranks.writer``), how the policy's HF directory is written
  (:meth:`~RankStrategy.write_policy_hf`) and how a checkpoint is saved and restored, whole or as
  per-rank shards (:meth:`~RankStrategy.save_checkpoint`, :meth:`~RankStrategy.rank_state`),
* whether the writer's weight push is measured (:meth:`~RankStrategy.push_meter`).

:class:`RankStrategy` itself is one process (the default). :class:`.data_parallel.DataParallel`
splits the samples and sums gradients; :class:`.model_parallel.ModelParallel` runs an engine's
shards on the same samples. :func:`rlcore.parallel.worker.strategy_for` picks one from the
engine's declared capabilities.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from rlcore.batch import PackedBatch
from rlcore.parallel.push_memory import NO_METER, PushMeter
from rlcore.pass_metrics import PassMetrics
from rlcore.ranks import SINGLE, Ranks, on_writer
from rlcore.run_output import save_checkpoint


class RankStrategy:
    """One process: it runs every micro-batch, reduces nothing, writes everything, saves the whole
    trainer state in one file. The distributed strategies override what differs."""

    def __init__(self, ranks: Ranks = SINGLE):
        self.ranks = ranks

    def prepare_stack(self, stack: Any) -> Any:
        """The stack this rank builds its providers from."""
        return stack

    def built(self, engine: Any, reference: Any) -> None:
        """After the engine (and the KL reference) are built, before anything runs."""

    # ------------------------------------------------------------------------ passes --

    def micro_batches(self, batch: PackedBatch, budget: int) -> list[PackedBatch]:
        """This rank's micro-batches of the step batch (token budget ``budget``)."""
        return batch.micro_batches(budget)

    def reduce_logprobs(self, logprobs: torch.Tensor) -> None:
        """A no-grad pass's per-token log-probs, filled at this rank's rows: complete them in place."""

    def reduce_gradients(self, parameters: Iterable[torch.Tensor]) -> None:
        """After the train pass's backward, before the optimizer step."""

    def reduce_metrics(self, metrics: PassMetrics) -> PassMetrics:
        """One pass's metrics over every rank's micro-batches."""
        return metrics

    # ------------------------------------------------------------------------ outputs --

    def write_policy_hf(self, engine: Any, model_dir: Path) -> None:
        """The policy as an HF directory (``policy_hf``, ``RUN/model``, ``step-N-hf``)."""
        on_writer(self.ranks, lambda: engine.save_hf(model_dir))

    def save_checkpoint(self, out: Path, rank_state: Callable[[], dict[str, Any]], run_state: dict[str, Any],
                        record: dict[str, Any], keep: int) -> None:
        """Commit step ``record["step"]``'s checkpoint: ``rank_state()`` (the engine's and the
        critic's state, which model-parallel ranks each hold a shard of) and ``run_state`` (the
        loop's: step, version, RNG, ...). Here: the writer saves both in one file."""
        on_writer(self.ranks, lambda: save_checkpoint(out, {**rank_state(), **run_state}, record, keep))

    def rank_state(self, out: Path, state: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
        """The loaded checkpoint ``state`` (with ``record``) completed with this rank's part."""
        return state

    def push_meter(self) -> PushMeter:
        """What measures the writer's memory during a weight push (here: nothing)."""
        return NO_METER
