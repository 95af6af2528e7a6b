"""What a run writes: ``metrics.jsonl`` (one JSON object per step), TensorBoard events when
tensorboard is installed, a reward-curve PNG, and an atomically replaced checkpoint."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch

METRICS_FILE = "metrics.jsonl"
CHECKPOINT_FILE = "checkpoint/state.pt"
PLOT_FILE = "reward_curve.png"


class MetricsWriter:
    def __init__(self, out_dir: Path, tensorboard: bool = True):
        self.path = out_dir / METRICS_FILE
        self.tb = None
        self.tb_note = ""
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(out_dir / "tensorboard"))
            except Exception as exc:  # noqa: BLE001 - tensorboard is optional
                self.tb_note = f"tensorboard not available ({type(exc).__name__}: {exc}); no event files"

    def truncate_after(self, step: int) -> None:
        """Drop lines of steps after ``step`` (a resumed run rewrites them)."""
        if not self.path.exists():
            return
        keep = [ln for ln in self.path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
        self.path.write_text("".join(ln + "\n" for ln in keep))

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self.tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and k != "step":
                    self.tb.add_scalar(k, v, record["step"])
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def read_metrics(out_dir: Path) -> list[dict[str, Any]]:
    path = Path(out_dir) / METRICS_FILE
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def plot_rewards(out_dir: Path, title: str = "") -> Path | None:
    rows = read_metrics(out_dir)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    reward = [r["reward_mean"] for r in rows]
    window = 5
    smooth = [sum(reward[max(0, i - window + 1): i + 1]) / len(reward[max(0, i - window + 1): i + 1]) for i in range(len(reward))]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    ax[0].plot(steps, reward, alpha=0.35, label="reward (step mean)")
    ax[0].plot(steps, smooth, label=f"{window}-step average")
    ax[0].set_xlabel("step")
    ax[0].set_ylabel("reward")
    ax[0].set_ylim(-0.02, 1.02 if max(reward) <= 1 else None)
    ax[0].legend(loc="lower right")
    ax[0].grid(alpha=0.3)
    if "entropy" in rows[0]:
        ax[1].plot(steps, [r.get("entropy", float("nan")) for r in rows], color="tab:green", label="entropy")
    if "kl" in rows[0] and any(r.get("kl") for r in rows):
        ax[1].plot(steps, [r.get("kl", float("nan")) for r in rows], color="tab:red", label="kl")
    ax[1].set_xlabel("step")
    ax[1].legend(loc="upper right")
    ax[1].grid(alpha=0.3)
    fig.suptitle(title or "rlcore train")
    fig.tight_layout()
    path = Path(out_dir) / PLOT_FILE
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def save_checkpoint(out_dir: Path, state: dict[str, Any]) -> Path:
    path = Path(out_dir) / CHECKPOINT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # a kill mid-save leaves the previous checkpoint intact
    return path


def load_checkpoint(out_dir: Path) -> dict[str, Any] | None:
    path = Path(out_dir) / CHECKPOINT_FILE
    if not path.exists():
        return None
    return torch.load(path, map_location="cpu", weights_only=False)
