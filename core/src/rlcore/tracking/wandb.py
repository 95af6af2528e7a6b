"""The ``wandb`` tracker: a Weights & Biases run, **offline** unless ``tracking.wandb.mode`` (or
``WANDB_MODE``) says otherwise: the run is written under ``<dir>/wandb/offline-run-*/`` and nothing
leaves the machine (``wandb sync`` uploads it later; ``wandb leet inspect`` reads it).

The resolved config is the run's config, with ``rlcore.versions`` and ``rlcore.run_dir`` beside it;
each step's metrics are one ``run.log(metrics, step=step)``; ``close`` is ``run.finish()``. wandb
keeps its hands off the console (``console="off"``: it would wrap stdout) and off the machine's
stats. Settings: ``tracking.wandb`` (:class:`rlcore.tracking.settings.WandbSettings`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rlcore.tracking.selection import config_dict, project_and_run

INSTALL = "pip install 'rlcore[wandb]'"


class WandbTracker:
    def __init__(self, run: Any):
        self.run = run

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


def start(run_dir: Path, config: Any, versions: dict[str, str]) -> WandbTracker:
    import wandb

    settings = config.tracking.wandb
    project, name = project_and_run(config, run_dir, settings.project, settings.name)
    mode = settings.mode or os.environ.get("WANDB_MODE") or "offline"
    where = Path(settings.dir) if settings.dir else Path(run_dir)
    where.mkdir(parents=True, exist_ok=True)
    run = wandb.init(
        project=project, entity=settings.entity, name=name, group=settings.group, tags=list(settings.tags) or None,
        mode=mode, dir=str(where), reinit="create_new",
        config={**config_dict(config), "rlcore": {"versions": dict(versions), "run_dir": str(Path(run_dir).resolve())}},
        settings=wandb.Settings(console="off", silent=True, x_disable_stats=True, disable_git=True,
                                save_code=False),
    )
    return WandbTracker(run)
