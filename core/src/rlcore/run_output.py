"""What a run writes, and the rules for reusing its directory.

* ``run.json``: marks the directory as an rlcore run (``--overwrite`` deletes only such a
  directory).
* ``metrics.jsonl``: one JSON object per step. A NaN or infinite value is written as the
  string ``"nan"``, ``"inf"`` or ``"-inf"`` (strict JSON has no such numbers; ``null`` would
  hide that the value was non-finite); :func:`read_metrics` turns them back into floats.
* TensorBoard events when tensorboard is installed, a reward-curve PNG.
* ``checkpoints/step-<step>.pt`` + ``step-<step>.json``: the state (``torch.save``, loaded
  with ``weights_only=True``: tensors, dicts, lists and numbers only, no code) and its commit
  record (sha256 and size of the state file, step, config fingerprint). Both are written to a
  temporary file in the same directory, fsynced, renamed and the directory fsynced; the record
  goes last, so a checkpoint without one is incomplete and never loaded. The newest
  ``output.keep_checkpoints`` are kept.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from rlcore.errors import CheckpointError, RunOutputError
from rlcore.faults import fault_point

METRICS_FILE = "metrics.jsonl"
RUN_MARKER = "run.json"
CHECKPOINT_DIR = "checkpoints"
LEGACY_CHECKPOINT = "checkpoint/state.pt"  # rlcore <= 0.x wrote one pickled file here
PLOT_FILE = "reward_curve.png"
CHECKPOINT_FORMAT = 1
_NONFINITE_TEXT = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


# --------------------------------------------------------------------------- output dir -----

def _looks_like_run(out: Path) -> bool:
    return any((out / name).exists() for name in (RUN_MARKER, METRICS_FILE, CHECKPOINT_DIR, "checkpoint"))


def prepare_output_dir(out: Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse to mix two runs in one directory.

    A new run needs an empty (or absent) directory; ``overwrite`` first deletes an existing
    rlcore run directory; ``resume`` needs a directory with a complete checkpoint."""
    out = Path(out)
    if resume and overwrite:
        raise RunOutputError("--resume and --overwrite contradict each other: choose one")
    if out.exists() and not out.is_dir():
        raise RunOutputError(f"output {out} exists and is not a directory")
    if resume:
        if not list_checkpoints(out):
            legacy = out / LEGACY_CHECKPOINT
            why = (f"; {legacy} is from an older rlcore (an unsafe pickle format), which this version does "
                   f"not load" if legacy.exists() else "")
            if not out.exists() or not any(out.iterdir()):
                raise RunOutputError(f"--resume: {out} is empty or absent, there is nothing to resume; "
                                     f"start the run without --resume")
            raise RunOutputError(
                f"--resume: no complete checkpoint in {out / CHECKPOINT_DIR}{why}. Start a new run with "
                f"--overwrite (deletes {out}) or another --output"
            )
        return
    if out.exists() and any(out.iterdir()):
        entries = sorted(p.name for p in out.iterdir())
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        if not overwrite:
            raise RunOutputError(
                f"output directory {out} is not empty ({shown}): pass --resume to continue the run in it, "
                f"--overwrite to delete it and start over, or choose another --output"
            )
        if not _looks_like_run(out):
            raise RunOutputError(
                f"--overwrite: {out} does not look like an rlcore run directory (no {RUN_MARKER}, "
                f"{METRICS_FILE} or {CHECKPOINT_DIR}/; it holds {shown}); refusing to delete it"
            )
        try:
            for p in out.iterdir():
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()
        except OSError as exc:
            raise RunOutputError(f"--overwrite: cannot clear {out}: {exc}") from exc
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunOutputError(f"cannot create output directory {out}: {exc}") from exc


def write_run_marker(out: Path, info: dict[str, Any]) -> None:
    _atomic_write_bytes(Path(out) / RUN_MARKER, (json.dumps(info, indent=1, sort_keys=True) + "\n").encode())


# ------------------------------------------------------------------------------ metrics -----

def encode_metric(value: Any) -> Any:
    """A non-finite float as the string ``"nan"``, ``"inf"`` or ``"-inf"``; anything else as is."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def _decode_row(row: dict[str, Any]) -> dict[str, Any]:
    return {k: (_NONFINITE_TEXT[v] if isinstance(v, str) and v in _NONFINITE_TEXT else v) for k, v in row.items()}


def _read_lines(path: Path) -> list[dict[str, Any]]:
    """Parsed lines of ``metrics.jsonl``. A final line without its newline is a write the process
    did not finish (it was killed): dropped. A bad line elsewhere is an error naming it."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise RunOutputError(f"cannot read {path}: {exc}") from exc
    lines = text.split("\n")
    torn = lines.pop()  # "" when the file ends with a newline
    rows = []
    for i, ln in enumerate(lines, 1):
        if not ln.strip():
            continue
        try:
            row = json.loads(ln)
            if not isinstance(row, dict) or "step" not in row:
                raise ValueError("not a step record")
        except ValueError as exc:
            raise RunOutputError(f"{path}:{i} is not a metrics record ({exc}): {ln[:80]!r}") from exc
        rows.append(row)
    del torn
    return rows


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
                self.tb_note = (f"tensorboard not available ({type(exc).__name__}: {exc}); no event files: "
                                f"pip install 'rlcore[tensorboard]', or set output.tensorboard=false")

    def truncate_after(self, step: int) -> None:
        """Drop lines of steps after ``step`` (a resumed run rewrites them); atomic."""
        if not self.path.exists():
            return
        keep = [row for row in _read_lines(self.path) if row["step"] <= step]
        _atomic_write_bytes(self.path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in keep).encode())

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps({k: encode_metric(v) for k, v in record.items()}, sort_keys=True, allow_nan=False)
        with self.path.open("a") as f:
            f.write(line + "\n")
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


class NullMetrics:
    """The metrics of a trainer rank that is not the writer: nothing is written."""

    tb_note = ""

    def truncate_after(self, step: int) -> None:
        pass

    def write(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def quiet_transformers() -> None:
    """transformers prints progress bars for every save/load; a step line is enough."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except Exception:  # noqa: BLE001 - cosmetic only
        pass


def read_metrics(out_dir: Path) -> list[dict[str, Any]]:
    path = Path(out_dir) / METRICS_FILE
    if not path.exists():
        return []
    return [_decode_row(r) for r in _read_lines(path)]


def plot_rewards(out_dir: Path, title: str = "") -> Path | None:
    rows = read_metrics(out_dir)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    reward = [r.get("reward_mean", float("nan")) for r in rows]
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


# ---------------------------------------------------------------------------- checkpoints -----

def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.parent / f".{path.name}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _stem(step: int) -> str:
    return f"step-{step:08d}"


def checkpoint_hf_dir(out_dir: Path, step: int) -> Path:
    """The Hugging Face export of the checkpoint of ``step``: ``checkpoints/step-<8 digits>-hf``
    (pruned together with that step's state file and record)."""
    return Path(out_dir) / CHECKPOINT_DIR / f"{_stem(step)}-hf"


def list_checkpoints(out_dir: Path) -> list[tuple[int, Path]]:
    """``(step, record path)`` of every checkpoint with a commit record, oldest first."""
    d = Path(out_dir) / CHECKPOINT_DIR
    if not d.is_dir():
        return []
    found = []
    for p in d.glob("step-*.json"):
        try:
            found.append((int(p.stem.split("-", 1)[1]), p))
        except ValueError:
            continue
    return sorted(found)


def save_checkpoint(out_dir: Path, state: dict[str, Any], meta: dict[str, Any], keep: int) -> Path:
    """Write the checkpoint of ``meta["step"]`` atomically, then delete all but the newest ``keep``.
    A kill at any point leaves every earlier checkpoint intact and loadable."""
    d = Path(out_dir) / CHECKPOINT_DIR
    stem = _stem(int(meta["step"]))
    final = d / f"{stem}.pt"
    tmp = d / f".{stem}.pt.tmp"
    try:
        d.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        fault_point("checkpoint_write")
        record = dict(meta, format=CHECKPOINT_FORMAT, state_file=final.name, state_bytes=tmp.stat().st_size,
                      state_sha256=_sha256(tmp), written=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        os.replace(tmp, final)
        _fsync_dir(d)
        fault_point("checkpoint_meta")
        _atomic_write_bytes(d / f"{stem}.json", (json.dumps(record, indent=1, sort_keys=True) + "\n").encode())
    except OSError as exc:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise CheckpointError(f"cannot write checkpoint {final}: {exc}; the earlier checkpoints are intact") from exc
    prune_checkpoints(out_dir, keep)
    return final


def prune_checkpoints(out_dir: Path, keep: int) -> None:
    """Keep the newest ``keep`` committed checkpoints; drop older ones, and leftovers of writes that
    were interrupted (temporary files, state files without a record)."""
    d = Path(out_dir) / CHECKPOINT_DIR
    committed = list_checkpoints(out_dir)
    keep_stems = {p.stem for _, p in committed[-max(keep, 1):]}
    for p in d.iterdir():
        stem = p.name.lstrip(".").split(".", 1)[0]
        if stem not in keep_stems:
            p.unlink(missing_ok=True)


def load_checkpoint(out_dir: Path, fingerprint: dict[str, Any] | None = None,
                    allow_config_change: bool = False) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """The newest committed checkpoint: ``(state, record, config differences)``.

    Raises :class:`CheckpointError` naming the file when there is none, when the state file is
    missing, truncated or altered (size and sha256 against the record), when it holds anything
    but tensors and plain data, or when it was written by another config (``fingerprint``
    differs) and ``allow_config_change`` is not set."""
    found = list_checkpoints(out_dir)
    if not found:
        raise CheckpointError(f"no complete checkpoint in {Path(out_dir) / CHECKPOINT_DIR}")
    step, rec_path = found[-1]
    older = ", ".join(p.stem for _, p in found[:-1]) or "none"
    hint = f" (older checkpoints: {older}; delete {rec_path} to resume from the one before)"
    try:
        record = json.loads(rec_path.read_text())
        if not isinstance(record, dict):
            raise ValueError("not a JSON object")
        state_path = rec_path.parent / str(record["state_file"])
        want_size, want_sha = int(record["state_bytes"]), str(record["state_sha256"])
        fmt = int(record.get("format", 0))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint record {rec_path} is unreadable: {type(exc).__name__}: {exc}{hint}") from exc
    if fmt != CHECKPOINT_FORMAT:
        raise CheckpointError(f"checkpoint {rec_path} has format {fmt}; this rlcore reads format {CHECKPOINT_FORMAT}")
    diffs: list[str] = []
    if fingerprint is not None:
        diffs = _config_diffs(record.get("config"), fingerprint)
        if diffs and not allow_config_change:
            raise CheckpointError(
                f"checkpoint {state_path} was written by a different config: {'; '.join(diffs[:8])}"
                + (f"; and {len(diffs) - 8} more" if len(diffs) > 8 else "")
                + ". Resume with the config it was written with, or pass --allow-config-change to resume anyway"
            )
    if not state_path.is_file():
        raise CheckpointError(f"checkpoint file {state_path} is missing{hint}")
    size = state_path.stat().st_size
    if size != want_size:
        raise CheckpointError(f"checkpoint file {state_path} is truncated or altered: {size} bytes, its record "
                              f"says {want_size}{hint}")
    if _sha256(state_path) != want_sha:
        raise CheckpointError(f"checkpoint file {state_path} is corrupt: its sha256 differs from the one recorded "
                              f"when it was written{hint}")
    try:
        state = torch.load(state_path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - anything torch raises on a bad or unsafe file
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise CheckpointError(f"cannot load checkpoint {state_path} safely: {type(exc).__name__}: {first[:300]}"
                              f"{hint}") from exc
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {state_path} holds a {type(state).__name__}, expected a dict")
    return state, record, diffs


def _config_diffs(saved: Any, current: dict[str, Any]) -> list[str]:
    from rlcore.config import fingerprint_diff

    if not isinstance(saved, dict):
        return ["(the checkpoint records no config)"]
    # JSON turned tuples into lists; compare like with like
    return fingerprint_diff(saved, json.loads(json.dumps(current)))
