"""Model parallelism for trainer ranks (rlcore-megatron's tensor/expert-parallel ranks).

Every rank holds a shard of the model and runs the whole step on the *same* samples: the writer
asks the rollout (a fleet of replicas) and broadcasts the samples (:func:`.data_parallel.rank_stack`,
as for data parallelism), then every rank packs the same batch, computes the same advantages
and takes the same step; the engine does the collectives (TP all-reduces, the EP dispatcher,
vocab-parallel log-probs), so the trainer splits and reduces nothing.

Rank-safe outputs: metrics, plot and the run marker by the writer (as in
:class:`~rlcore.trainer.Trainer`). The HF exports gather every tensor over the ranks, so every
rank takes part and the writer writes: ``policy_hf`` (``save_hf``), the trained model (``RUN/model``
and ``checkpoints/step-N-hf``: :mod:`rlcore.export`) and each weight push (the writer's sync
feeds the fleet; the others drain the export, :class:`.data_parallel.FollowerSync`).

Checkpoints are sharded: each rank saves its own engine state (model and optimizer shard) to
``checkpoints/step-NNNNNNNN.rank_{r}-of-{world}.pt``, then the writer commits the step's record
(the trainer state, the engine's ``parallel_layout()`` and every shard's size and sha256) once
all shards are written; older checkpoints are pruned with their shards. ``--resume`` loads each
rank's own shard after checking it and refuses a checkpoint of another layout (other tp/ep/world)
naming the keys: shards are not resharded.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlcore.parallel.data_parallel import rank_stack
from rlcore.parallel.push_memory import MeasuredPush
from rlcore.errors import CheckpointError
from rlcore.export import export_policy
from rlcore.ranks import Ranks, on_writer
from rlcore.run_output import CHECKPOINT_DIR, _sha256, _stem, checkpoint_hf_dir, save_checkpoint
from rlcore.stack import Stack
from rlcore.trainer import Trainer

#: the config keys of each layout dimension, named by a layout error
LAYOUT_KEYS = {"tp": "cluster.trainer.tp / megatron.tensor_parallel_size",
               "ep": "cluster.trainer.ep / megatron.expert_parallel_size",
               "etp": "megatron's expert tensor-parallel size (follows tp)",
               "pp": "cluster.trainer.pp", "world": "the number of trainer ranks (cluster.trainer.*)"}


def shard_file(step: int, rank: int, world: int) -> str:
    return f"{_stem(step)}.rank_{rank}-of-{world}.pt"


class ModelParallelTrainer(MeasuredPush, Trainer):
    """:class:`~rlcore.trainer.Trainer` over the model-parallel ranks of one model
    (torch.distributed is initialised; see the module docstring). ``rollout``: the writer's
    rollout backend (a fleet of replicas); ``None`` builds the configured one in the writer."""

    def __init__(self, stack: Stack, ranks: Ranks, rollout: Any = None, **kwargs: Any):
        super().__init__(rank_stack(stack, ranks, rollout), ranks=ranks, **kwargs)
        get_layout = getattr(self.engine, "parallel_layout", None)
        layout = dict(get_layout()) if callable(get_layout) else {}
        layout.pop("rank", None)
        layout["world"] = ranks.world
        self.layout = layout

    # ------------------------------------------------------------------ HF exports ------

    def _write_policy_hf(self, model_dir: Path) -> None:
        # the export gathers each tensor over the ranks: every rank takes part, the writer writes;
        # policy_hf at start, and through rlcore.export.export_policy RUN/model and step-N-hf
        self.engine.save_hf(model_dir)
        self.ranks.barrier()  # written before the writer's rollout reads it (or commits the directory)

    # ----------------------------------------------------------------- checkpoints ------

    def _checkpoint(self, wall: float) -> None:
        import random

        from rlcore import __version__

        self._check_weights_finite("checkpoint")
        ckpt = self.out / CHECKPOINT_DIR
        ckpt.mkdir(parents=True, exist_ok=True)
        shard = ckpt / shard_file(self.step, self.ranks.rank, self.ranks.world)
        tmp = ckpt / f".{shard.name}.tmp"
        with open(tmp, "wb") as f:
            torch.save(self.engine.state_dict(), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, shard)
        mine = {"file": shard.name, "bytes": shard.stat().st_size, "sha256": _sha256(shard)}
        files: list[Any] = [None] * self.ranks.world
        dist.all_gather_object(files, mine)  # also the barrier: every shard is on disk
        state = {"engine": {"sharded": dict(self.layout)}, "step": self.step, "version": self.version,
                 "wall_seconds": wall, "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
                 "rlcore_version": __version__}
        meta = {"step": self.step, "version": self.version, "rlcore_version": __version__,
                "config": self.fingerprint, "shards": {"layout": dict(self.layout), "files": files}}
        on_writer(self.ranks, lambda: save_checkpoint(self.out, state, meta, keep=int(self.cfg.output.keep_checkpoints)))
        export_policy(self, checkpoint_hf_dir(self.out, self.step), self.step, at_checkpoint=True)  # every rank gathers

    def _restore(self) -> None:
        state, record, diffs = self._resume_from
        path = self.out / CHECKPOINT_DIR / str(record["state_file"])
        shards = record.get("shards")
        if not shards:
            raise CheckpointError(f"checkpoint {path} holds one gathered engine state (written by a single "
                                  f"process), not per-rank shards: resume it without cluster.backend=ray")
        saved = dict(shards["layout"])
        changed = [k for k in sorted(set(saved) | set(self.layout)) if saved.get(k) != self.layout.get(k)]
        if changed:
            what = "; ".join(f"{k}: {saved.get(k)} in the checkpoint, {self.layout.get(k)} now "
                             f"({LAYOUT_KEYS.get(k, k)})" for k in changed)
            raise CheckpointError(f"checkpoint {path} was written by ranks of another layout ({what}): per-rank "
                                  f"shards are not resharded; resume with the layout it was written with")
        info = shards["files"][self.ranks.rank]
        shard = path.parent / str(info["file"])
        if not shard.is_file():
            raise CheckpointError(f"checkpoint shard {shard} of rank {self.ranks.rank} is missing")
        if shard.stat().st_size != int(info["bytes"]) or _sha256(shard) != str(info["sha256"]):
            raise CheckpointError(f"checkpoint shard {shard} is truncated or altered (size or sha256 differs from "
                                  f"the record {path.with_suffix('.json')})")
        try:
            engine_state = torch.load(shard, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - anything torch raises on a bad or unsafe file
            raise CheckpointError(f"cannot load checkpoint shard {shard}: {type(exc).__name__}: {exc}") from exc
        self._resume_from = (dict(state, engine=engine_state), record, diffs)
        t0 = time.perf_counter()
        super()._restore()
        self.console.print(f"loaded shard {shard.name} in {time.perf_counter() - t0:.2f} s")
