"""The ``tensorboard`` tracker: TensorBoard event files (``torch.utils.tensorboard.SummaryWriter``).

Every step's metrics are scalars at that step; the resolved config (YAML), the versions and the run
directory are text summaries ``rlcore/config``, ``rlcore/versions`` and ``rlcore/run_dir`` at step 0.
Settings: ``tracking.tensorboard`` (:class:`rlcore.tracking.settings.TensorBoardSettings`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

INSTALL = "pip install 'rlcore[tensorboard]'"
DEFAULT_DIR = "tensorboard"


class TensorBoardTracker:
    def __init__(self, writer: Any):
        self.writer = writer

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def start(run_dir: Path, config: Any, versions: dict[str, str]) -> TensorBoardTracker:
    from omegaconf import OmegaConf
    from torch.utils.tensorboard import SummaryWriter

    settings = config.tracking.tensorboard
    writer = SummaryWriter(str(Path(settings.dir) if settings.dir else Path(run_dir) / DEFAULT_DIR))
    # text summaries are markdown: the YAML and JSON go in code blocks
    writer.add_text("rlcore/config", "```\n" + OmegaConf.to_yaml(config, resolve=True) + "```", 0)
    writer.add_text("rlcore/versions", "```\n" + json.dumps(versions, indent=1, sort_keys=True) + "\n```", 0)
    writer.add_text("rlcore/run_dir", str(Path(run_dir).resolve()), 0)
    writer.flush()
    return TensorBoardTracker(writer)
