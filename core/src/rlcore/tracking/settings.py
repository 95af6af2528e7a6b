"""The settings of core's built-in trackers: ``tracking.<backend>`` (docs/tracking.md).

:class:`rlcore.config.TrackingConfig` holds one of these per built-in backend; a setting of a
backend that ``tracking.backends`` does not list is kept but not used. ``None`` means "the
default": ``tracking.project`` for a project or experiment name, ``tracking.run_name`` (itself
defaulting to the name of the run directory) for a run name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlcore.errors import ConfigError

WANDB_MODES = ("offline", "online", "disabled")


@dataclass
class TensorBoardSettings:
    """``dir``: where the event files go (default: ``<run dir>/tensorboard``)."""

    dir: str | None = None


@dataclass
class MlflowSettings:
    """``tracking_uri``: the MLflow store: ``sqlite:///path/mlflow.db`` (MLflow's recommended local
    store), ``file:///path/mlruns`` (MLflow's file store, which MLflow keeps in maintenance mode:
    rlcore sets ``MLFLOW_ALLOW_FILE_STORE=true`` for it) or a server's ``http(s)://`` address;
    default: ``MLFLOW_TRACKING_URI`` when set, else ``sqlite:///<run dir>/mlflow/mlflow.db``.
    ``experiment``: the experiment (created when missing; default ``tracking.project``);
    ``run_name``: default ``tracking.run_name``; ``artifact_location``: where a new experiment of a
    sqlite store keeps its artifacts (default: ``mlartifacts`` beside the database; MLflow's own
    default would be ``./mlruns`` in the current directory)."""

    tracking_uri: str | None = None
    experiment: str | None = None
    run_name: str | None = None
    artifact_location: str | None = None


@dataclass
class WandbSettings:
    """``mode``: ``offline`` (the run is written under ``dir`` and nothing leaves the machine:
    ``wandb sync`` uploads it later), ``online`` (needs ``wandb login``) or ``disabled``; default:
    ``WANDB_MODE`` when set, else ``offline``. ``dir``: where wandb writes (default: the run
    directory, so the run's files are in ``<run dir>/wandb/``). ``project`` default
    ``tracking.project``, ``name`` default ``tracking.run_name``."""

    mode: str | None = None
    project: str | None = None
    entity: str | None = None
    name: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)
    dir: str | None = None


@dataclass
class TrackioSettings:
    """``dir``: trackio's local store (its ``TRACKIO_DIR``; default: trackio's own,
    ``$TRACKIO_DIR`` or ``$HF_HOME/trackio``, where ``trackio show`` looks). trackio reads it once,
    when first imported: a process that already imported trackio with another one refuses it.
    ``project`` default ``tracking.project``, ``name`` default ``tracking.run_name``."""

    project: str | None = None
    name: str | None = None
    group: str | None = None
    dir: str | None = None


def check_tracking(cfg: Any) -> None:
    """Values types cannot rule out (a backend's name is checked against the installed trackers when
    the stack is resolved: rlcore.tracking.selection)."""
    t = cfg.tracking
    for i, name in enumerate(t.backends):
        if not str(name).strip():
            raise ConfigError(f"bad value for config key 'tracking.backends': entry {i} is empty; name a tracker "
                              f"(tensorboard, mlflow, wandb, trackio)", key="tracking.backends")
    if t.wandb.mode is not None and t.wandb.mode not in WANDB_MODES:
        raise ConfigError(f"bad value for config key 'tracking.wandb.mode': {t.wandb.mode!r}; choose one of: "
                          f"{', '.join(WANDB_MODES)}", key="tracking.wandb.mode")
    if not str(t.project).strip():
        raise ConfigError("bad value for config key 'tracking.project': it is empty", key="tracking.project")
