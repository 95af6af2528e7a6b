"""The ``trackio`` tracker: a trackio run in trackio's local store (a sqlite database per project in
its ``TRACKIO_DIR``; ``trackio show`` opens the dashboard over it).

The run's config is the resolved config, with ``rlcore.versions`` and ``rlcore.run_dir`` beside it;
each step's metrics are one ``run.log(metrics, step=step)``; ``close`` is ``run.finish()``. trackio's
own lines on stdout (project initialised, run created) are kept off the run's console, and it logs
no CPU or GPU stats. A Space or a server (``TRACKIO_SPACE_ID``, ``TRACKIO_SERVER_URL``) is trackio's
own business: it reads them from the environment. Settings: ``tracking.trackio``
(:class:`rlcore.tracking.settings.TrackioSettings`).
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path
from typing import Any

from rlcore.tracking.selection import config_dict, project_and_run

INSTALL = "pip install 'rlcore[trackio]'"


class TrackioTracker:
    def __init__(self, run: Any):
        self.run = run

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        from trackio import context_vars

        with contextlib.redirect_stdout(io.StringIO()):
            self.run.finish()
        if context_vars.current_run.get() is self.run:  # as trackio.finish(): its exit hook would finish it again
            context_vars.current_run.set(None)


def _use_dir(wanted: str | None) -> None:
    """trackio fixes its store (``TRACKIO_DIR``) when first imported."""
    if not wanted:
        return
    path = Path(wanted).expanduser().resolve()
    if "trackio" in sys.modules:
        from trackio import utils

        if Path(utils.TRACKIO_DIR).resolve() != path:
            raise RuntimeError(f"tracking.trackio.dir is {path}, but trackio was imported in this process with "
                               f"its store at {utils.TRACKIO_DIR} (trackio reads TRACKIO_DIR once, at import)")
        return
    os.environ["TRACKIO_DIR"] = str(path)


def start(run_dir: Path, config: Any, versions: dict[str, str]) -> TrackioTracker:
    settings = config.tracking.trackio
    _use_dir(settings.dir)
    import trackio

    project, name = project_and_run(config, run_dir, settings.project, settings.name)
    with contextlib.redirect_stdout(io.StringIO()):
        run = trackio.init(
            project=project, name=name, group=settings.group, embed=False, auto_log_cpu=False, auto_log_gpu=False,
            config={**config_dict(config),
                    "rlcore": {"versions": dict(versions), "run_dir": str(Path(run_dir).resolve())}},
        )
    return TrackioTracker(run)
