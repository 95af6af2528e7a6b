"""Which trackers a run has, and running them so that none can lose the run.

:func:`select_trackers` (called by :func:`rlcore.stack.resolve`, so ``rlcore check`` says it too) turns
``tracking.backends`` into :class:`~rlcore.types.TrackerSpec`\\ s through the plugin manager's
:meth:`~rlcore.manager.PluginManager.select_all` (the ``tracker`` role selects many providers), checks
that each one's package is there, and adds ``tensorboard`` while ``output.tensorboard`` (on by
default) asks for it: that one is soft, as it always was (its package missing is a note, not an error).

:class:`Trackers` runs the selected trackers on the writer rank: each starts with the run directory,
the resolved config and :func:`run_versions`; each step's finite numeric metrics go to every live
tracker. A tracker that raises is warned about once (:class:`~rlcore.tracking.TrackerWarning`) and
switched off; nothing a tracker does stops the run or the ``metrics.jsonl`` line.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import math
import platform
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rlcore.errors import ConfigError, one_line
from rlcore.tracking import TrackerWarning
from rlcore.types import Tracker, TrackerSpec

TENSORBOARD = "tensorboard"
#: the note of a run whose ``output.tensorboard`` (the default) finds no tensorboard package
TENSORBOARD_NOTE = ("no TensorBoard event files: tensorboard is not installed; every metric is in metrics.jsonl. "
                    "pip install 'rlcore[tensorboard]' for event files, or set output.tensorboard=false to drop "
                    "this note")


def importable(module: str) -> bool:
    """Whether ``module`` can be imported, found without importing it (a top-level name stays cheap)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def select_trackers(cfg: Any, pm: Any) -> tuple[list[TrackerSpec], list[str]]:
    """The trackers of ``cfg`` in order, and the notes to show: ``tracking.backends`` (an unknown name
    or one listed twice is a :class:`~rlcore.errors.ConfigError` naming the key; a tracker whose
    package is missing one naming its ``install`` line), then ``tensorboard`` when ``output.tensorboard``
    is true, installed and not listed already."""
    names = [str(n).strip().lower() for n in cfg.tracking.backends]
    wants_tb = bool(cfg.output.tensorboard)
    if TENSORBOARD in names and not wants_tb:
        raise ConfigError("tracking.backends lists 'tensorboard' but output.tensorboard is false: drop one of the "
                          "two (output.tensorboard=false turns TensorBoard off)", key="output.tensorboard")
    specs: list[TrackerSpec] = pm.select_all("tracker", names, key="tracking.backends")
    for spec in specs:
        missing = [m for m in spec.requires if not importable(m)]
        if missing:
            how = spec.install or f"install the package{'s' if len(missing) > 1 else ''} {', '.join(missing)}"
            raise ConfigError(f"tracking.backends: tracker {spec.name!r} ({spec.source()}) needs "
                              f"{', '.join(missing)}, which is not installed: {how}", key="tracking.backends")
    notes: list[str] = []
    tb = pm.trackers().get(TENSORBOARD) if wants_tb and TENSORBOARD not in names else None
    if tb is not None:
        if all(importable(m) for m in tb.requires):
            specs.insert(0, tb)
        else:
            notes.append(TENSORBOARD_NOTE)
    return specs, notes


def run_versions(pm: Any) -> dict[str, str]:
    """What each tracker records as the run's versions: Python, rlcore, torch, transformers and every
    active plugin (``plugin/<name>``: its distribution and version)."""
    from rlcore.discovery import core_version

    out = {"python": platform.python_version(), "rlcore": core_version()}
    for dist in ("torch", "transformers"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    for name in pm.active:
        out[f"plugin/{name}"] = pm.plugin_label(name)
    return out


def config_dict(config: Any) -> dict[str, Any]:
    """The resolved config as plain containers (a plain dict passes as it is)."""
    from omegaconf import OmegaConf

    if OmegaConf.is_config(config):
        return OmegaConf.to_container(config, resolve=True)  # type: ignore[return-value]
    return dict(config)


def flat_config(config: Any) -> dict[str, Any]:
    """``{"algorithm.kl_coef": 0.0, "plugins": [...], ...}``: the config's leaves by dotted key (lists
    are leaves), for trackers whose parameters are flat (MLflow)."""
    out: dict[str, Any] = {}

    def walk(node: Mapping[str, Any], prefix: str) -> None:
        for k, v in node.items():
            if isinstance(v, dict) and v:
                walk(v, f"{prefix}{k}.")
            else:
                out[f"{prefix}{k}"] = v

    walk(config_dict(config), "")
    return out


def project_and_run(config: Any, run_dir: Path, project: str | None, run: str | None) -> tuple[str, str]:
    """A backend's project and run name: its own setting, else ``tracking.project`` and
    ``tracking.run_name``, else the name of the run directory."""
    t = config.tracking
    return (str(project or t.project), str(run or t.run_name or Path(run_dir).resolve().name))


def numeric_metrics(record: Mapping[str, Any]) -> dict[str, float]:
    """A metrics line's finite numbers, ``step`` aside: what trackers get (text such as ``stopped``,
    and non-finite values, stay in metrics.jsonl only)."""
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class Trackers:
    """The run's live trackers (see the module docstring). ``Trackers()`` is none."""

    def __init__(self, live: Iterable[tuple[TrackerSpec, Tracker]] = ()):
        self._live = list(live)

    @classmethod
    def start(cls, specs: Sequence[TrackerSpec], run_dir: Path | str, config: Any,
              versions: Mapping[str, str]) -> Trackers:
        """Each spec's ``factory(run_dir, config, versions)``; one that raises, or returns something
        without ``log`` and ``close``, is warned about and left out."""
        live = []
        for spec in specs:
            try:
                tracker = spec.factory(Path(run_dir), config, dict(versions))
                if not (callable(getattr(tracker, "log", None)) and callable(getattr(tracker, "close", None))):
                    raise TypeError(f"its factory returned {type(tracker).__name__}, which lacks log(step, metrics) "
                                    f"or close()")
            except Exception as exc:  # noqa: BLE001 - no tracker may stop the run
                _warn(spec, "did not start", exc)
                continue
            live.append((spec, tracker))
        return cls(live)

    @property
    def names(self) -> list[str]:
        """The trackers still live, in order."""
        return [spec.name for spec, _ in self._live]

    def log(self, step: int, record: Mapping[str, Any]) -> None:
        """The finite numeric metrics of ``record`` (a metrics.jsonl line) to every live tracker."""
        metrics = numeric_metrics(record)
        for spec, tracker in list(self._live):
            try:
                tracker.log(int(step), dict(metrics))
            except Exception as exc:  # noqa: BLE001 - no tracker may stop the run
                self._live.remove((spec, tracker))
                _warn(spec, f"failed at step {step}", exc)
                _close_quietly(tracker)

    def close(self) -> None:
        live, self._live = self._live, []
        for spec, tracker in live:
            try:
                tracker.close()
            except Exception as exc:  # noqa: BLE001
                _warn(spec, "failed to close", exc)


def _warn(spec: TrackerSpec, what: str, exc: BaseException) -> None:
    warnings.warn(f"tracker {spec.name!r} ({spec.source()}) {what}: {type(exc).__name__}: {one_line(exc)}; it is "
                  f"off for the rest of the run, every metric is still in metrics.jsonl", TrackerWarning, stacklevel=3)


def _close_quietly(tracker: Any) -> None:
    try:
        tracker.close()
    except Exception:  # noqa: BLE001 - its failure was warned about already
        pass
