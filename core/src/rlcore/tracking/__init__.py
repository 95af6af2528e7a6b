"""Experiment tracking: where each step's metrics go besides ``metrics.jsonl`` (docs/tracking.md).

Trackers are providers of the ``tracker`` hook (:class:`rlcore.types.TrackerSpec`), a role that a
config fills with **several** providers at once: ``tracking.backends: [tensorboard, mlflow]``. Core's
built-ins, one module each, import their package only when selected:

* :mod:`rlcore.tracking.tensorboard`: TensorBoard event files (``torch.utils.tensorboard``)
* :mod:`rlcore.tracking.mlflow`: an MLflow run in a local store (sqlite or ``file:``) or a server
* :mod:`rlcore.tracking.wandb`: a Weights & Biases run, offline by default
* :mod:`rlcore.tracking.trackio`: a trackio run in its local store

:mod:`rlcore.tracking.selection` selects them from the config (``stack.resolve``) and runs them
(:class:`~rlcore.tracking.selection.Trackers`, which :class:`rlcore.run_output.MetricsWriter` calls
where it writes each step's line); :mod:`rlcore.tracking.settings` holds the built-ins' settings.
``metrics.jsonl`` is the record of the run: a tracker that fails is warned about once
(:class:`TrackerWarning`) and switched off, and the run goes on.
"""

from __future__ import annotations


class TrackerWarning(RuntimeWarning):
    """A tracker failed (at start, logging a step or closing): it is switched off for the rest of the
    run; every metric is still in ``metrics.jsonl``. Warned once per tracker, naming it and the error."""


__all__ = ["TrackerWarning"]
