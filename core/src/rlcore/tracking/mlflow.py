"""The ``mlflow`` tracker: an MLflow run, through ``mlflow.tracking.MlflowClient`` (no global active run,
so it never clashes with the user's own ``mlflow.start_run``).

The resolved config goes in as the run's params (flattened: ``algorithm.kl_coef``) and as the
artifact ``rlcore/config.yaml``; the versions as tags ``rlcore.version.<name>`` and the artifact
``rlcore/versions.json``; the run directory as the tag ``rlcore.run_dir``. Each step's metrics are
one ``log_batch`` at that step; ``close`` ends the run ``FINISHED``. Settings: ``tracking.mlflow``
(:class:`rlcore.tracking.settings.MlflowSettings`). ``mlflow-skinny`` is enough; a sqlite store
also needs SQLAlchemy and alembic (both in ``rlcore[mlflow]``).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

from rlcore.tracking.selection import flat_config, project_and_run

INSTALL = "pip install 'rlcore[mlflow]'"
#: MLflow's limits: params and metrics per log_batch call, characters of a param value
MAX_PARAMS, MAX_METRICS, MAX_PARAM_VALUE = 100, 1000, 6000
_BAD_NAME = re.compile(r"[^\w\-. :/]")  # MLflow names: alphanumerics, _ - . space : /


def _name(key: str) -> str:
    return _BAD_NAME.sub("_", key)


def tracking_uri(settings: Any, run_dir: Path) -> str:
    """The store: the setting, else ``MLFLOW_TRACKING_URI``, else a sqlite database in the run directory."""
    if settings.tracking_uri:
        return str(settings.tracking_uri)
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{Path(run_dir).resolve() / 'mlflow' / 'mlflow.db'}"


def _artifact_location(settings: Any, uri: str) -> str | None:
    if settings.artifact_location:
        return str(settings.artifact_location)
    if uri.startswith("sqlite:///"):  # MLflow's default would be ./mlruns in the current directory
        return (Path(uri[len("sqlite:///"):]).resolve().parent / "mlartifacts").as_uri()
    return None


class MlflowTracker:
    def __init__(self, client: Any, run_id: str):
        self.client, self.run_id = client, run_id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [Metric(_name(k), v, now, step) for k, v in metrics.items()]
        for i in range(0, len(rows), MAX_METRICS):
            self.client.log_batch(self.run_id, metrics=rows[i:i + MAX_METRICS])

    def close(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED")


def start(run_dir: Path, config: Any, versions: dict[str, str]) -> MlflowTracker:
    settings = config.tracking.mlflow
    uri = tracking_uri(settings, run_dir)
    if uri.startswith("file:") or "://" not in uri:  # the user asked for MLflow's file store by name
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    if uri.startswith("sqlite:///"):
        Path(uri[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    from mlflow.entities import Param
    from mlflow.tracking import MlflowClient
    from omegaconf import OmegaConf

    experiment_name, run_name = project_and_run(config, run_dir, settings.experiment, settings.run_name)
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(experiment_name)
    experiment_id = (experiment.experiment_id if experiment is not None else
                     client.create_experiment(experiment_name, artifact_location=_artifact_location(settings, uri)))
    tags = {"rlcore.run_dir": str(Path(run_dir).resolve()),
            **{_name(f"rlcore.version.{k}"): str(v) for k, v in versions.items()}}
    run_id = client.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id
    params = [Param(_name(k), str(v)[:MAX_PARAM_VALUE]) for k, v in flat_config(config).items()]
    for i in range(0, len(params), MAX_PARAMS):
        client.log_batch(run_id, params=params[i:i + MAX_PARAMS])
    client.log_text(run_id, OmegaConf.to_yaml(config, resolve=True), "rlcore/config.yaml")
    client.log_dict(run_id, dict(versions), "rlcore/versions.json")
    return MlflowTracker(client, run_id)
