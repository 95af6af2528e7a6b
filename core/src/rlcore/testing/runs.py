"""Runs in tests: start one as ``rlcore`` does, read what it wrote, compare two.

* :func:`main` is the ``rlcore`` command line (``main(["train", config, ...])``), :class:`Trainer`
  the loop it runs in one process (``Trainer(stack).run()``);
* :func:`read_metrics`, :func:`list_checkpoints`, :func:`load_checkpoint` read a run directory;
* :func:`comparable_metrics`: what two runs of one config must agree on, their ``metrics.jsonl``
  rows without the timings.

A run's timing metrics (``*_seconds``, ``sync/<phase>_seconds``, ``tokens_per_second``) differ
between identical runs; everything else a deterministic run logs (rewards, losses, gradient norms,
bytes, versions) must not. Tests that compare a resumed, async, Ray or fault-injected run with a
plain one compare :func:`comparable_metrics` of both.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rlcore.cli import main
from rlcore.run_output import list_checkpoints, load_checkpoint, read_metrics
from rlcore.trainer import Trainer

__all__ = ["Trainer", "comparable_metrics", "is_timing_metric", "list_checkpoints", "load_checkpoint", "main",
           "read_metrics"]


def is_timing_metric(name: str) -> bool:
    """Whether ``name`` is a wall-clock measurement (by the metric naming rule of
    docs/writing-plugins.md: durations end in ``_seconds``)."""
    return name.endswith("_seconds") or name == "tokens_per_second"


def comparable_metrics(rows_or_path: Iterable[dict[str, Any]] | str | Path,
                       drop_prefixes: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """The rows (or a run directory's / a file's ``metrics.jsonl``) without timing metrics and
    without the metrics starting with any of ``drop_prefixes`` (e.g. ``("loop/",)``)."""
    if isinstance(rows_or_path, (str, Path)):
        path = Path(rows_or_path)
        path = path / "metrics.jsonl" if path.is_dir() else path
        rows: Iterable[dict[str, Any]] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    else:
        rows = rows_or_path
    return [{k: v for k, v in r.items() if not is_timing_metric(k) and not k.startswith(drop_prefixes)}
            for r in rows]
