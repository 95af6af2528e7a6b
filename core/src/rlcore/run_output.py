"""What a run writes, and the rules for reusing its directory.

* ``run.json``: marks the directory as an rlcore run (``{"rlcore_run": 1, ...}``); ``--overwrite``
  deletes only such a directory, never one that merely holds files with rlcore's names.
* ``run.lock``: held (flock) by the one process writing the run (:mod:`rlcore.run_lock`).
* ``metrics.jsonl``: one JSON object per step. A NaN or infinite value is written as the
  string ``"nan"``, ``"inf"`` or ``"-inf"`` (strict JSON has no such numbers; ``null`` would
  hide that the value was non-finite); :func:`read_metrics` turns them back into floats.
* the experiment trackers' files (TensorBoard events by default, when tensorboard is installed: rlcore.tracking),
  a reward-curve PNG.
* ``checkpoints/step-<step>.pt`` + ``step-<step>.json``: the state (``torch.save``, loaded
  with ``weights_only=True``: tensors, dicts, lists and numbers only, no code) and its commit
  record (sha256 and size of the state file, step, config fingerprint). Both are written to a
  temporary file in the same directory, fsynced, renamed and the directory fsynced; the record
  goes last, so a checkpoint without one is incomplete and never loaded, and a committed one is
  never written again. The newest ``output.keep_checkpoints`` are kept; pruning deletes only
  rlcore's own names (:func:`own_checkpoint_step`), never a user's file in ``checkpoints/``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from rlcore.errors import CheckpointError, RunOutputError
from rlcore.faults import fault_point
from rlcore.run_lock import LOCK_FILE, RunLock

METRICS_FILE = "metrics.jsonl"
RUN_MARKER = "run.json"
CHECKPOINT_DIR = "checkpoints"
LEGACY_CHECKPOINT = "checkpoint/state.pt"  # rlcore <= 0.x wrote one pickled file here
PLOT_FILE = "reward_curve.png"
CHECKPOINT_FORMAT = 1
_NONFINITE_TEXT = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


# --------------------------------------------------------------------------- output dir -----

#: the key and value in ``run.json`` that make a directory rlcore's (``--overwrite`` deletes no other)
MARKER_KEY = "rlcore_run"
MARKER_VERSION = 1


def is_rlcore_run(out: Path) -> bool:
    """Whether ``out`` holds rlcore's run marker (not merely files with rlcore's names)."""
    try:
        info = json.loads((Path(out) / RUN_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and info.get(MARKER_KEY) == MARKER_VERSION


class RunDirectory:
    """The writer's hold on its output directory: the lock (:mod:`rlcore.run_lock`) and what a
    start that fails must remove. ``new``: a new run (created or cleared the directory);
    ``created``: the topmost directory this process created, ``None`` when it was there."""

    def __init__(self, path: Path, lock: RunLock, new: bool, created: Path | None):
        self.path, self.lock, self.new, self.created = path, lock, new, created

    def release(self) -> None:
        self.lock.release()

    def abandon(self) -> None:
        """The start failed: a new run removes what it created (the directories it made, else the
        entries of the directory, which was empty when it took it), so that nothing makes the
        retry refuse; a ``--resume`` start deletes nothing. Then the lock is released."""
        try:
            if self.new and self.lock.held:
                if self.created is not None:
                    shutil.rmtree(self.created, ignore_errors=True)
                else:
                    for p in self.path.iterdir():
                        _remove(p)
        except OSError:
            pass  # best effort: the error that failed the start is the one to report
        finally:
            self.release()


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    else:
        p.unlink(missing_ok=True)


def _entries(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name != LOCK_FILE) if out.is_dir() else []


def precious_dir(path: Path | str) -> str | None:
    """Why no message may suggest deleting ``path`` and ``--overwrite`` never clears it, or ``None``:
    the root, a top-level directory (``/usr``, ``/home``), the home directory, or a directory that
    holds the home directory, the current directory, Python's installation or rlcore's."""
    p = Path(os.path.realpath(path))
    if p == p.parent:
        return "the root directory"
    if p.parent == p.parent.parent:
        return "a top-level directory"
    holds = {"your home directory": Path.home(), "the current directory": Path.cwd(),
             "Python's installation": Path(sys.prefix), "rlcore's installation": Path(__file__).parent}
    for what, q in holds.items():
        q = Path(os.path.realpath(q))
        if what == "your home directory" and p == q:
            return "your home directory"
        if p in q.parents:
            return f"a directory that holds {what}"
    return None


def _topmost_missing(out: Path) -> Path | None:
    top = None
    for d in [out, *out.parents]:
        if d.exists():
            break
        top = d
    return top


def prepare_output_dir(out: Path | str, *, resume: bool, overwrite: bool, info: dict[str, Any] | None = None
                       ) -> RunDirectory:
    """Take the run directory for this process: refuse to mix two runs (or two processes) in one.

    A new run needs an empty (or absent) directory; ``overwrite`` first deletes an existing run
    directory, and only one that rlcore's marker identifies; ``resume`` needs a directory with a
    complete checkpoint. The lock is held until :meth:`RunDirectory.release`; a new run's
    directory is marked (``info`` goes into the marker)."""
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
            if not _entries(out):
                raise RunOutputError(f"--resume: {out} is empty or absent, there is nothing to resume; "
                                     f"start the run without --resume")
            fresh = ("another --output" if precious_dir(out) else f"--overwrite (deletes {out}) or another --output")
            raise RunOutputError(
                f"--resume: no complete checkpoint in {out / CHECKPOINT_DIR}{why}. Start a new run with {fresh}"
            )
        return RunDirectory(out, RunLock.acquire(out), new=False, created=None)
    created = None
    entries = _entries(out)
    if entries:
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        if RunLock.holder(out) is not None:  # in use: say by whom, before anything else
            RunLock.acquire(out).release()  # raises naming the holder (unless it just ended)
        precious = precious_dir(out)
        if not overwrite:
            if precious:  # never suggest deleting /, $HOME, or what holds the current directory
                raise RunOutputError(f"output directory {out} is not empty ({shown}) and is {precious}: choose "
                                     f"another --output (a new or empty directory)")
            raise RunOutputError(
                f"output directory {out} is not empty ({shown}): pass --resume to continue the run in it, "
                f"--overwrite to delete it and start over, or choose another --output"
            )
        if precious:
            raise RunOutputError(f"--overwrite: refusing to clear {out}: it is {precious}; choose another --output")
        if not is_rlcore_run(out):
            raise RunOutputError(
                f"--overwrite: {out} is not an rlcore run directory (no rlcore {RUN_MARKER}; it holds {shown}); "
                f"refusing to delete it. A run of an older rlcore has no marker: if this is one, delete it "
                f"yourself (rm -r {shlex.quote(str(out))}) or choose another --output"
            )
        lock = RunLock.acquire(out)
        try:
            for p in out.iterdir():
                if p.name != LOCK_FILE:
                    _remove(p)
        except OSError as exc:
            lock.release()
            raise RunOutputError(f"--overwrite: cannot clear {out}: {exc}") from exc
    else:
        created = _topmost_missing(out)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RunOutputError(f"cannot create output directory {out}: {exc.strerror or exc}") from exc
        try:
            lock = RunLock.acquire(out)
        except RunOutputError:
            if created is not None and not _entries(out):
                shutil.rmtree(created, ignore_errors=True)
            raise
        if _entries(out):  # another process started a run here, and ended, since we looked
            lock.release()
            raise RunOutputError(f"output directory {out} is not empty any more ({', '.join(_entries(out)[:5])}): "
                                 f"another run started in it; choose another --output")
    run = RunDirectory(out, lock, new=True, created=created)
    try:
        write_run_marker(out, dict(info or {}, started=time.strftime("%Y-%m-%dT%H:%M:%S%z")))
    except BaseException:
        run.abandon()
        raise
    return run


def write_run_marker(out: Path, info: dict[str, Any]) -> None:
    """``run.json``: what identifies the directory as rlcore's (``{"rlcore_run": 1, ...}``)."""
    record = dict(info, **{MARKER_KEY: MARKER_VERSION})
    path = Path(out) / RUN_MARKER
    try:
        _atomic_write_bytes(path, (json.dumps(record, indent=1, sort_keys=True) + "\n").encode())
    except OSError as exc:
        raise RunOutputError(f"cannot write {path}: {exc.strerror or exc}") from exc


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
    """Each step's line of ``metrics.jsonl`` (fsynced), then the same metrics to the run's experiment
    trackers (``trackers``: :class:`rlcore.tracking.selection.Trackers`, started by the caller; none
    by default). The line is written first and no tracker can stop it."""

    def __init__(self, out_dir: Path, trackers: Any = None):
        from rlcore.tracking.selection import Trackers

        self.path = out_dir / METRICS_FILE
        self.trackers = trackers if trackers is not None else Trackers()

    def truncate_after(self, step: int) -> None:
        """Drop lines of steps after ``step`` (a resumed run rewrites them); atomic."""
        if not self.path.exists():
            return
        keep = [row for row in _read_lines(self.path) if row["step"] <= step]
        try:
            _atomic_write_bytes(self.path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in keep).encode())
        except OSError as exc:
            raise RunOutputError(f"cannot rewrite {self.path}: {exc.strerror or exc}") from exc

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps({k: encode_metric(v) for k, v in record.items()}, sort_keys=True, allow_nan=False)
        try:
            with self.path.open("a") as f:
                f.write(line + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            raise RunOutputError(f"cannot write metrics to {self.path}: {exc.strerror or exc}") from exc
        self.trackers.log(record["step"], record)  # a tracker that fails is warned about and switched off

    def close(self) -> None:
        self.trackers.close()


class NullMetrics:
    """The metrics of a trainer rank that is not the writer: nothing is written."""

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


def reward_axis_limits(rewards: list[float]) -> tuple[float, float]:
    """The reward plot's y-range: the fixed frame [0, 1] (padded) when every finite reward lies in
    it, so runs of 0/1 rewards compare at a glance; else the data's own range, padded, so that
    negative or large rewards are never cut off."""
    finite = [float(r) for r in rewards if isinstance(r, (int, float)) and math.isfinite(r)]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 1.0)
    if lo >= 0.0 and hi <= 1.0:
        lo, hi = 0.0, 1.0
    pad = 0.02 * hi - 0.02 * lo if hi > lo else max(0.02 * abs(hi), 0.02)  # (hi - lo) may overflow
    return max(lo - pad, -sys.float_info.max), min(hi + pad, sys.float_info.max)


def reward_figure(rows: list[dict[str, Any]], title: str = "") -> Any:
    """The reward (left) and entropy/KL (right) figure of the metrics rows, a matplotlib Figure."""
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
    ax[0].set_ylim(*reward_axis_limits(reward))
    ax[0].legend(loc="best")
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
    return fig


def plot_rewards(out_dir: Path, title: str = "") -> Path | None:
    rows = read_metrics(out_dir)
    if not rows:
        return None
    import matplotlib.pyplot as plt

    fig = reward_figure(rows, title)
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
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    _fsync_dir(path.parent)


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def _write_failure(exc: BaseException) -> str:
    """Why a write failed, in one line. torch.save turns a failed write() (EFBIG, ENOSPC) into
    ``RuntimeError: [enforce fail at inline_container.cc:...] unexpected pos ...`` with the
    OSError as its context: name the OSError."""
    seen = exc
    while seen is not None and not isinstance(seen, OSError):
        seen = seen.__cause__ or seen.__context__
    if isinstance(seen, OSError):
        return str(seen)
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


def sha256_file(path: Path) -> str:
    """The sha256 of a file's bytes, read in 4 MiB blocks (checkpoint records, export manifests)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _stem(step: int) -> str:
    return f"step-{step:08d}"


#: every name rlcore writes in checkpoints/, with the step it belongs to: the state, its record,
#: the HF export (a directory), model-parallel shards, and their temporaries (``.step-*.tmp``,
#: ``.step-<8d>-hf.tmp*`` directories). Pruning touches these names and no other.
_OWN_NAME = re.compile(r"step-(\d{8})(?:\.pt|\.json|-hf|\.rank_\d+-of-\d+\.pt)"
                       r"|\.step-(\d{8})(?:\.pt|\.json|\.rank_\d+-of-\d+\.pt)\.tmp"
                       r"|\.step-(\d{8})-hf\.tmp[^/]*")


def own_checkpoint_step(name: str) -> int | None:
    """The step of a name rlcore writes in ``checkpoints/``; ``None`` for anyone else's name."""
    m = _OWN_NAME.fullmatch(name)
    return None if m is None else int(next(g for g in m.groups() if g is not None))


def checkpoint_hf_dir(out_dir: Path, step: int) -> Path:
    """The Hugging Face export of the checkpoint of ``step``: ``checkpoints/step-<8 digits>-hf``
    (pruned together with that step's state file and record)."""
    return Path(out_dir) / CHECKPOINT_DIR / f"{_stem(step)}-hf"


def is_committed(out_dir: Path, step: int) -> bool:
    """Whether the checkpoint of ``step`` has its commit record (it is then never written again)."""
    return (Path(out_dir) / CHECKPOINT_DIR / f"{_stem(step)}.json").is_file()


def list_checkpoints(out_dir: Path) -> list[tuple[int, Path]]:
    """``(step, record path)`` of every checkpoint with a commit record, oldest first."""
    d = Path(out_dir) / CHECKPOINT_DIR
    if not d.is_dir():
        return []
    found = []
    for p in d.glob("step-*.json"):
        step = own_checkpoint_step(p.name)
        if step is not None and p.is_file():
            found.append((step, p))
    return sorted(found)


def save_checkpoint(out_dir: Path, state: dict[str, Any], meta: dict[str, Any], keep: int) -> Path:
    """Write the checkpoint of ``meta["step"]`` atomically, then delete all but the newest ``keep``.
    A kill at any point leaves every earlier checkpoint intact and loadable; a write that fails
    (disk full, file-size limit, read-only directory) is a :class:`CheckpointError` and leaves no
    temporary file. A committed checkpoint is never written again (a kill half-way through would
    turn the newest good checkpoint into a corrupt one)."""
    d = Path(out_dir) / CHECKPOINT_DIR
    stem = _stem(int(meta["step"]))
    final = d / f"{stem}.pt"
    tmp = d / f".{stem}.pt.tmp"
    if (d / f"{stem}.json").exists():
        raise CheckpointError(f"checkpoint {final} is already committed; a committed checkpoint is never rewritten")
    try:
        d.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        fault_point("checkpoint_write")
        record = dict(meta, format=CHECKPOINT_FORMAT, state_file=final.name, state_bytes=tmp.stat().st_size,
                      state_sha256=sha256_file(tmp), written=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        os.replace(tmp, final)
        _fsync_dir(d)
        fault_point("checkpoint_meta")
        _atomic_write_bytes(d / f"{stem}.json", (json.dumps(record, indent=1, sort_keys=True) + "\n").encode())
    except BaseException as exc:  # a signal that stops the run at once, too: never leave the temporary
        _unlink_quietly(tmp)
        if not isinstance(exc, Exception):
            raise
        raise CheckpointError(f"cannot write checkpoint {final}: {_write_failure(exc)}; the older checkpoints "
                              f"are intact") from exc
    prune_checkpoints(out_dir, keep)
    return final


def prune_checkpoints(out_dir: Path, keep: int) -> None:
    """Keep the newest ``keep`` committed checkpoints; drop older ones, and leftovers of writes that
    were interrupted (temporary files, state files without a record). Only rlcore's own names
    (:func:`own_checkpoint_step`) are touched, each step's files and HF export together: anything
    else in ``checkpoints/`` (``best.pt``, notes) is the user's."""
    d = Path(out_dir) / CHECKPOINT_DIR
    committed = list_checkpoints(out_dir)
    keep_steps = {step for step, _ in committed[-max(keep, 1):]}
    for p in d.iterdir():
        step = own_checkpoint_step(p.name)
        if step is None or step in keep_steps:
            continue
        try:
            _remove(p)
        except OSError as exc:
            raise CheckpointError(f"the checkpoint is written, but the older {p} cannot be deleted "
                                  f"(output.keep_checkpoints={keep}): {exc.strerror or exc}") from exc


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
    record, state_path = read_checkpoint_record(rec_path, hint)
    diffs: list[str] = []
    if fingerprint is not None:
        diffs = _config_diffs(record.get("config"), fingerprint)
        if diffs and not allow_config_change:
            raise CheckpointError(
                f"checkpoint {state_path} was written by a different config: {'; '.join(diffs[:8])}"
                + (f"; and {len(diffs) - 8} more" if len(diffs) > 8 else "")
                + ". Resume with the config it was written with, or pass --allow-config-change to resume anyway"
            )
    return load_checkpoint_state(state_path, record, hint), record, diffs


def read_checkpoint_record(rec_path: Path, hint: str = "") -> tuple[dict[str, Any], Path]:
    """A checkpoint's commit record and the path of its state file; :class:`CheckpointError`
    (``hint`` appended) when the record is unreadable or of another format."""
    try:
        record = json.loads(rec_path.read_text())
        if not isinstance(record, dict):
            raise ValueError("not a JSON object")
        state_path = rec_path.parent / str(record["state_file"])
        int(record["state_bytes"]), str(record["state_sha256"])  # present and well-formed
        fmt = int(record.get("format", 0))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint record {rec_path} is unreadable: {type(exc).__name__}: {exc}{hint}") from exc
    if fmt != CHECKPOINT_FORMAT:
        raise CheckpointError(f"checkpoint {rec_path} has format {fmt}; this rlcore reads format {CHECKPOINT_FORMAT}")
    return record, state_path


def load_checkpoint_state(state_path: Path, record: dict[str, Any], hint: str = "") -> dict[str, Any]:
    """The state file checked against its record (present, size, sha256), then loaded with
    ``weights_only=True``: tensors and plain data only. :class:`CheckpointError` naming the file."""
    want_size, want_sha = int(record["state_bytes"]), str(record["state_sha256"])
    if not state_path.is_file():
        raise CheckpointError(f"checkpoint file {state_path} is missing{hint}")
    size = state_path.stat().st_size
    if size != want_size:
        raise CheckpointError(f"checkpoint file {state_path} is truncated or altered: {size} bytes, its record "
                              f"says {want_size}{hint}")
    if sha256_file(state_path) != want_sha:
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
    return state


def _config_diffs(saved: Any, current: dict[str, Any]) -> list[str]:
    from rlcore.config import fingerprint_diff

    if not isinstance(saved, dict):
        return ["(the checkpoint records no config)"]
    # JSON turned tuples into lists; compare like with like
    return fingerprint_diff(saved, json.loads(json.dumps(current)))
