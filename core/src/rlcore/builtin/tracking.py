"""Built-in plugin ``tracking``: the experiment trackers ``tensorboard``, ``mlflow``, ``wandb`` and
``trackio`` (rlcore/tracking/; docs/tracking.md). Listing them imports none of their packages."""

from rlcore import PLUGIN_API, hookimpl
from rlcore.types import TrackerSpec

__all__ = ["PLUGIN_API", "tracker"]


@hookimpl
def tracker():
    from rlcore.tracking import mlflow, tensorboard, trackio, wandb

    yield TrackerSpec(name="tensorboard", factory=tensorboard.start, requires=("tensorboard",),
                      install=tensorboard.INSTALL, description="TensorBoard event files in <run dir>/tensorboard")
    yield TrackerSpec(name="mlflow", factory=mlflow.start, requires=("mlflow",), install=mlflow.INSTALL,
                      description="an MLflow run: a local sqlite or file store, or a tracking server")
    yield TrackerSpec(name="wandb", factory=wandb.start, requires=("wandb",), install=wandb.INSTALL,
                      description="a Weights & Biases run, offline by default")
    yield TrackerSpec(name="trackio", factory=trackio.start, requires=("trackio",), install=trackio.INSTALL,
                      description="a trackio run in its local store")
