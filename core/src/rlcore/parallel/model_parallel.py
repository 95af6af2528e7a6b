"""Model parallelism for trainer ranks (engines with ``Cap.TENSOR_PARALLEL`` or
``Cap.EXPERT_PARALLEL``, such as rlcore-megatron's): the rank strategy :class:`ModelParallel`.

Every rank holds a shard of the model; the writer asks the rollout (a fleet of replicas) and
broadcasts the samples (:func:`.data_parallel.rank_stack`, as for data parallelism), then every
rank packs the same batch and computes the same advantages. The ranks of one model replica run
the same sequences; the engine does the collectives (TP all-reduces, the EP dispatcher,
vocab-parallel log-probs).

Data parallelism beside the model split (an engine that also declares ``Cap.DATA_PARALLEL``, such
as rlcore-megatron with ``cluster.trainer.dp`` > 1): the engine names its data-parallel group
(``engine.data_parallel_group()``: the ranks holding the same shard, one per model replica), and
each forward pass runs only that replica's contiguous share of the sequences, exactly as
:class:`.data_parallel.DataParallel` splits them over whole-model ranks. The loss of every
micro-batch is normalised by the *whole step's* divisor, so gradients are all-reduced with SUM
over the data-parallel group (rlcore's reduce, not megatron's DDP, which averages and keeps its
own gradient buffers: the engine's optimizer and gradient norm read ``.grad``), log-probs of the
no-grad passes the same way, and a pass's metrics combine over that group (the model-parallel
peers of a replica computed the same ones).

Pipeline stages (an engine with ``Cap.PIPELINE_PARALLEL`` whose ``pipeline_group()`` names this
rank's pipeline and the global rank of its last stage): the engine runs the stages inside each
``forward`` and the trainer's head and loss run on every rank, but only the last stage's are
real (rlcore-megatron's ``rlcore_megatron.pipeline``): each pass's log-probs and metrics are
broadcast from the last stage over the pipeline, after the data-parallel reduce.

Rank-safe outputs: metrics, plot and the run marker by the writer (as on one process). The HF exports gather every tensor over the ranks, so every
rank takes part and the writer writes: ``policy_hf`` (``save_hf``), the trained model (``RUN/model``
and ``checkpoints/step-N-hf``: :mod:`rlcore.export`) and each weight push (the writer's sync
feeds the fleet; the others drain the export, :class:`.data_parallel.FollowerSync`).

Checkpoints are sharded: each rank saves its own part of the state (the engine's model and
optimizer shard, and PPO's critic's, ``{"engine": ..., "critic": ...}``) to
``checkpoints/step-NNNNNNNN.rank_{r}-of-{world}.pt``, then the writer commits the step's record
(the trainer state, the engine's ``parallel_layout()`` and every shard's size and sha256) once
all shards are written; older checkpoints are pruned with their shards. ``--resume`` loads each
rank's own shard (engine and critic) after checking it and refuses a checkpoint of another layout (other tp/ep/world)
naming the keys: shards are not resharded.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlcore.batch import PackedBatch
from rlcore.errors import CheckpointError, RLCoreError
from rlcore.parallel.data_parallel import DistributedRanks, all_reduce_gradients, shard_bounds
from rlcore.pass_metrics import PassMetrics
from rlcore.ranks import on_writer
from rlcore.run_output import CHECKPOINT_DIR, _stem, save_checkpoint, sha256_file

#: the config keys of each layout dimension, named by a layout error
LAYOUT_KEYS = {"tp": "cluster.trainer.tp / megatron.tensor_parallel_size",
               "ep": "cluster.trainer.ep / megatron.expert_parallel_size",
               "etp": "megatron's expert tensor-parallel size (follows tp)",
               "pp": "cluster.trainer.pp / megatron.pipeline_parallel_size", "vpp": "megatron.virtual_pipeline_stages",
               "dp": "cluster.trainer.dp", "world": "the number of trainer ranks (cluster.trainer.*)"}


def shard_file(step: int, rank: int, world: int) -> str:
    return f"{_stem(step)}.rank_{rank}-of-{world}.pt"


class ModelParallel(DistributedRanks):
    """The model-parallel ranks of one model, in one or several data-parallel replicas
    (torch.distributed is initialised; see the module docstring). ``splits_samples``: the engine
    declares ``Cap.DATA_PARALLEL`` too, so it names its data-parallel group once built."""

    layout: dict[str, Any]

    def __init__(self, ranks: Any, rollout: Any = None, splits_samples: bool = False):
        super().__init__(ranks, rollout)
        self.splits_samples = splits_samples
        self.dp_group: Any = None  # None: every rank runs every sequence
        self.dp_rank, self.dp_size = 0, 1
        self.pipeline: tuple[Any, int] | None = None  # (group, the last stage's global rank)

    def built(self, engine: Any, reference: Any) -> None:
        get_layout = getattr(engine, "parallel_layout", None)
        layout = dict(get_layout()) if callable(get_layout) else {}
        layout.pop("rank", None)
        layout["world"] = self.ranks.world
        self.layout = layout
        if self.splits_samples:
            group_of = getattr(engine, "data_parallel_group", None)
            if not callable(group_of):
                raise RLCoreError(f"engine {type(engine).__name__} declares data_parallel beside model parallelism "
                                  f"but has no data_parallel_group(): its ranks cannot tell which split the samples")
            self.dp_group = group_of()
            if self.dp_group is not None:
                self.dp_rank, self.dp_size = dist.get_rank(self.dp_group), dist.get_world_size(self.dp_group)
        pipeline_of = getattr(engine, "pipeline_group", None)
        self.pipeline = pipeline_of() if callable(pipeline_of) else None

    # the passes: split over the data-parallel replicas (nothing to do with one replica)

    def micro_batches(self, batch: PackedBatch, budget: int) -> list[PackedBatch]:
        if self.dp_size == 1:
            return batch.micro_batches(budget)
        start, stop = shard_bounds(batch.num_seqs, self.dp_rank, self.dp_size)
        return batch.select_seqs(start, stop).micro_batches(budget) if start < stop else []

    def reduce_logprobs(self, logprobs: torch.Tensor) -> None:
        if self.dp_size > 1:
            dist.all_reduce(logprobs, group=self.dp_group)  # each replica filled its own sequences' rows
        if self.pipeline is not None:
            group, last = self.pipeline
            dist.broadcast(logprobs, src=last, group=group)

    def reduce_gradients(self, parameters: Iterable[torch.Tensor]) -> None:
        if self.dp_size > 1:
            all_reduce_gradients(list(parameters), self.dp_group)

    def reduce_metrics(self, metrics: PassMetrics) -> PassMetrics:
        if self.dp_size > 1:
            parts: list[Any] = [None] * self.dp_size
            dist.all_gather_object(parts, metrics, group=self.dp_group)
            metrics = PassMetrics.combine(parts)
        if self.pipeline is not None:
            group, last = self.pipeline
            box = [metrics]
            dist.broadcast_object_list(box, src=last, group=group)
            metrics = box[0]
        return metrics

    def write_policy_hf(self, engine: Any, model_dir: Path) -> None:
        # the export gathers each tensor over the ranks: every rank takes part, the writer writes;
        # policy_hf at start, and through rlcore.export.export_policy RUN/model and step-N-hf
        engine.save_hf(model_dir)
        self.ranks.barrier()  # written before the writer's rollout reads it (or commits the directory)

    def save_checkpoint(self, out: Path, rank_state: Callable[[], dict[str, Any]], run_state: dict[str, Any],
                        record: dict[str, Any], keep: int) -> None:
        ckpt = out / CHECKPOINT_DIR
        ckpt.mkdir(parents=True, exist_ok=True)
        shard = ckpt / shard_file(int(record["step"]), self.ranks.rank, self.ranks.world)
        tmp = ckpt / f".{shard.name}.tmp"
        with open(tmp, "wb") as f:
            torch.save(rank_state(), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, shard)
        mine = {"file": shard.name, "bytes": shard.stat().st_size, "sha256": sha256_file(shard)}
        files: list[Any] = [None] * self.ranks.world
        dist.all_gather_object(files, mine)  # also the barrier: every shard is on disk
        state = {"engine": {"sharded": dict(self.layout)}, **run_state}
        meta = {**record, "shards": {"layout": dict(self.layout), "files": files}}
        on_writer(self.ranks, lambda: save_checkpoint(out, state, meta, keep))

    def rank_state(self, out: Path, state: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
        path = out / CHECKPOINT_DIR / str(record["state_file"])
        shards = record.get("shards")
        if not shards:
            raise CheckpointError(f"checkpoint {path} holds one gathered engine state (written by a single "
                                  f"process), not per-rank shards: resume it without cluster.backend=ray")
        saved = dict(shards["layout"])
        # a dimension one side does not record is 1 there (checkpoints from before dp/vpp were recorded)
        changed = [k for k in sorted(set(saved) | set(self.layout)) if saved.get(k, 1) != self.layout.get(k, 1)]
        if changed:
            what = "; ".join(f"{k}: {saved.get(k)} in the checkpoint, {self.layout.get(k)} now "
                             f"({LAYOUT_KEYS.get(k, k)})" for k in changed)
            raise CheckpointError(f"checkpoint {path} was written by ranks of another layout ({what}): per-rank "
                                  f"shards are not resharded; resume with the layout it was written with")
        info = shards["files"][self.ranks.rank]
        shard = path.parent / str(info["file"])
        if not shard.is_file():
            raise CheckpointError(f"checkpoint shard {shard} of rank {self.ranks.rank} is missing")
        if shard.stat().st_size != int(info["bytes"]) or sha256_file(shard) != str(info["sha256"]):
            raise CheckpointError(f"checkpoint shard {shard} is truncated or altered (size or sha256 differs from "
                                  f"the record {path.with_suffix('.json')})")
        try:
            mine = torch.load(shard, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - anything torch raises on a bad or unsafe file
            raise CheckpointError(f"cannot load checkpoint shard {shard}: {type(exc).__name__}: {exc}") from exc
        if not isinstance(mine, dict) or "engine" not in mine:
            raise CheckpointError(f"checkpoint shard {shard} holds no engine state (a shard of an older rlcore, "
                                  f"which saved the engine's state alone): resume it with that version")
        return {**state, **mine}
