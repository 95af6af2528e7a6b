"""The trained model out of a run, as a Hugging Face directory.

What a run leaves (the writer rank writes; ``output.export_hf`` chooses how much):

* ``RUN/model/``: the policy at the end of the run (completed or stopped at a step boundary);
* ``RUN/checkpoints/step-<8 digits>-hf/``: the policy of each checkpoint (pruned with it);
* ``RUN/policy_hf/``: *not* the trained model, the directory the rollout engine starts from
  (written once at start-up).

Each directory holds the safetensors weights, ``config.json``, the tokenizer files (and the
generation config when the model has one), plus ``rlcore_export.json`` (step, weight version).
It is written into a temporary sibling (``.<name>.tmp``), fsynced, and only then renamed to its
final name, swapping atomically with an older one (``renameat2(RENAME_EXCHANGE)`` on Linux, else
two renames with the old one kept aside as ``.<name>.tmp-old`` until the new one is in place): a kill
mid-write never leaves a half directory under the final name and never replaces a good one.

``rlcore export RUN [--step N] [--out DIR]`` (:func:`export_checkpoint`) rebuilds the engine from
the run's resolved config (``RUN/config.yaml``), loads the committed checkpoint of step ``N``
(default: the newest) after checking its size and sha256 against its record, with
``torch.load(weights_only=True)``, and writes the directory to ``DIR`` (default
``RUN/export-step-N``). It always rebuilds from the checkpoint state, so it also works for runs
with ``output.export_hf: never`` and for checkpoints whose ``-hf`` directory was deleted;
``RUN/model`` and ``checkpoints/step-N-hf`` are such exports already, usable as they are.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rlcore.errors import CheckpointError, RunOutputError

#: the directory of the trained model at the end of a run
MODEL_DIR = "model"
#: the resolved config of the run (its latest start), beside ``metrics.jsonl``
CONFIG_FILE = "config.yaml"
#: inside an exported directory: which step and weight version it holds
EXPORT_INFO = "rlcore_export.json"


# ------------------------------------------------------------------- atomic directories -----

def staging_dir(final: Path) -> Path:
    """Where the directory that becomes ``final`` is written (a fixed name: every model-parallel
    rank computes the same path; one process writes a run, so no two writers share it)."""
    return final.parent / f".{final.name}.tmp"


def _aside_dir(final: Path) -> Path:
    # ``.<name>.tmp*``: the names checkpoint pruning knows as this step's leftovers (run_output)
    return final.parent / f".{final.name}.tmp-old"


def begin_dir(final: Path) -> Path:
    """An empty staging directory for ``final``. Leftovers of an interrupted write are cleared
    first; an old ``final`` that a kill left aside (between the two renames of the fallback swap)
    is put back."""
    final = Path(final)
    staging, aside = staging_dir(final), _aside_dir(final)
    if aside.exists():
        if final.exists():
            shutil.rmtree(aside)
        else:
            os.rename(aside, final)
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def _fsync_tree(d: Path) -> None:
    for p in sorted(d.rglob("*")):
        if p.is_file() and not p.is_symlink():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(d)


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    system or the file system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def commit_dir(staging: Path, final: Path, info: dict[str, Any]) -> Path:
    """Write ``info`` into ``staging``, make it durable and give it the name ``final`` (replacing
    an older ``final`` atomically)."""
    staging, final = Path(staging), Path(final)
    (staging / EXPORT_INFO).unlink(missing_ok=True)  # never write through a hard link (link_or_copy_dir)
    (staging / EXPORT_INFO).write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
    _fsync_tree(staging)
    if not final.exists():
        os.rename(staging, final)
    elif _exchange(staging, final):
        shutil.rmtree(staging)  # now the old one
    else:
        aside = _aside_dir(final)
        os.rename(final, aside)
        os.rename(staging, final)
        shutil.rmtree(aside)
    _fsync_dir(final.parent)
    return final


def write_dir(final: Path, write: Callable[[Path], None], info: dict[str, Any]) -> Path:
    """``write(staging)`` then :func:`commit_dir`; an error removes the staging directory and
    leaves any older ``final`` as it was."""
    staging = begin_dir(final)
    try:
        write(staging)
        return commit_dir(staging, final, info)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def link_or_copy_dir(src: Path, dest: Path) -> None:
    """Fill ``dest`` with ``src``'s files as hard links (no second copy of the weights on disk;
    safe because an export is never modified in place, only replaced), copies where the file
    system has no hard links."""
    for p in sorted(Path(src).rglob("*")):
        if p.name == EXPORT_INFO:
            continue  # the new directory gets its own
        target = dest / p.relative_to(src)
        if p.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(p, target)
        except OSError:
            shutil.copy2(p, target)


def export_info(step: int, weight_version: int, source: str) -> dict[str, Any]:
    from rlcore import __version__

    return {"step": int(step), "weight_version": int(weight_version), "source": source,
            "rlcore_version": __version__, "written": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def read_export_info(model_dir: Path) -> dict[str, Any] | None:
    try:
        info = json.loads((Path(model_dir) / EXPORT_INFO).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def write_run_config(out: Path, text: str) -> None:
    """``RUN/config.yaml``: the resolved config, replaced atomically (``rlcore export`` reads it)."""
    from rlcore.run_output import _atomic_write_bytes

    _atomic_write_bytes(Path(out) / CONFIG_FILE, text.encode())


# ----------------------------------------------------------------------------- in a run -----

def export_policy(trainer: Any, final: Path, step: int, *, at_checkpoint: bool) -> None:
    """The trainer's policy as a Hugging Face directory at ``final``, if ``output.export_hf`` asks
    for it (``checkpoints``: at each checkpoint and at the end; ``final``: at the end; ``never``).

    Every rank calls it: the tensors go through ``trainer._write_policy_hf`` (model-parallel
    ranks gather them together, the writer writes), the directory work is the writer's. At the
    end of a run, a checkpoint export of the same step and weight version is reused (hard links:
    the weights are not written twice)."""
    from rlcore.ranks import on_writer
    from rlcore.run_output import checkpoint_hf_dir

    mode = trainer.cfg.output.export_hf
    if mode == "never" or (at_checkpoint and mode != "checkpoints") or step < 0:
        return
    ranks = trainer.ranks
    info = export_info(step, trainer.version, "checkpoint" if at_checkpoint else "end of run")
    staging = Path(on_writer(ranks, lambda: begin_dir(final)))
    same = None if at_checkpoint else checkpoint_hf_dir(trainer.out, step)

    def reuse() -> bool:
        held = read_export_info(same) if same is not None else None
        if not held or held.get("step") != step or held.get("weight_version") != trainer.version:
            return False
        link_or_copy_dir(same, staging)
        return True

    try:
        if not on_writer(ranks, reuse):
            trainer._write_policy_hf(staging)
        on_writer(ranks, lambda: commit_dir(staging, final, info))
    except BaseException as exc:  # a signal that stops the run at once, too: no staging directory left
        if ranks.writer:  # no collective here: the other ranks may not have failed
            shutil.rmtree(staging, ignore_errors=True)
        if not isinstance(exc, (OSError, RuntimeError)):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"cannot write the Hugging Face export {final}: {first}"
                              + ("; the checkpoint itself is committed" if at_checkpoint else "")) from exc


# ------------------------------------------------------------------------- rlcore export -----

def load_checkpoint_of_step(run: Path, step: int) -> dict[str, Any]:
    """The state of the committed checkpoint of ``step``, checked as ``--resume`` checks it
    (record readable, size and sha256 of the state file, ``weights_only`` load)."""
    from rlcore.run_output import (
        checkpoint_hf_dir,
        list_checkpoints,
        load_checkpoint_state,
        read_checkpoint_record,
    )

    found = dict(list_checkpoints(run))
    rec_path = found[step]
    record, state_path = read_checkpoint_record(rec_path)
    shards = record.get("shards")
    if shards:
        layout = ", ".join(f"{k}={v}" for k, v in sorted(dict(shards.get("layout", {})).items()))
        raise CheckpointError(
            f"checkpoint {rec_path} is sharded over model-parallel ranks ({layout}); rlcore export runs in one "
            f"process and does not gather shards: use {checkpoint_hf_dir(run, step)} or {run / MODEL_DIR}, "
            f"which the run wrote with every rank (output.export_hf)")
    state = load_checkpoint_state(state_path, record)
    if not isinstance(state.get("engine"), dict):
        raise CheckpointError(f"checkpoint {state_path} holds no engine state")
    return state


def build_engine(stack: Any) -> Any:
    """The training engine of ``stack``, built as the trainer builds it (platform, task for a tiny
    model's vocabulary, the engine plugin's section) without rollout, sync or optimizer."""
    import random

    import torch

    from rlcore.platforms import resolve_device
    from rlcore.tasks import load_callable
    from rlcore.types import BuildContext

    cfg = stack.config
    torch.manual_seed(cfg.training.seed)  # a tiny model is created before the checkpoint lands in it
    random.seed(cfg.training.seed)
    task = load_callable(cfg.data.task, "data.task")(cfg.data)
    sections = {ps.plugin: ps.section for ps in stack.plugins.plugin_settings()}

    def ctx(spec: Any, **kw: Any) -> BuildContext:
        section = sections.get(spec.plugin)
        return BuildContext(config=cfg, settings=cfg[section] if section else None, extras={"task": task}, **kw)

    platform_ctx = ctx(stack.platform) if stack.platform is not None else BuildContext(config=cfg)
    resolved = resolve_device(cfg.engine.device, ctx=platform_ctx, spec=stack.platform)
    return stack.engine.factory(ctx(stack.engine, device=resolved.device, platform=resolved.platform))


def export_checkpoint(run: str | Path, step: int | None = None, out: str | Path | None = None,
                      overrides: Sequence[str] = ()) -> Path:
    """Write the policy of the checkpoint of ``step`` (default: the newest) of ``run`` as a Hugging
    Face directory at ``out`` (default ``RUN/export-step-N``); returns ``out``. ``overrides``:
    dotlist changes to the saved config (``engine.device=cpu`` to export a GPU run on a CPU)."""
    from rlcore.run_output import list_checkpoints, quiet_transformers
    from rlcore.stack import load_stack

    run = Path(run)
    if not run.is_dir():
        raise RunOutputError(f"no such run: {run} is not a directory")
    config = run / CONFIG_FILE
    if not config.is_file():
        raise RunOutputError(f"{run} holds no {CONFIG_FILE} (the resolved config an rlcore run writes at start): "
                             f"not an rlcore run directory, or one written before rlcore saved it")
    steps = [s for s, _ in list_checkpoints(run)]
    if not steps:
        raise CheckpointError(f"{run} has no complete checkpoint in {run / 'checkpoints'} to export")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise CheckpointError(f"{run} has no checkpoint of step {step}; steps with a checkpoint: "
                              f"{', '.join(map(str, steps))}")
    dest = Path(out) if out is not None else run / f"export-step-{step}"
    if dest.exists():
        raise RunOutputError(f"output {dest} exists: choose another --out or delete it")
    state = load_checkpoint_of_step(run, step)
    quiet_transformers()
    engine = build_engine(load_stack(config, overrides))
    try:
        engine.load_state_dict(state["engine"])
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        detail = " ".join(ln.strip() for ln in str(exc).splitlines() if ln.strip())[:300]
        raise CheckpointError(f"checkpoint of step {step} does not fit the engine of {config}: "
                              f"{type(exc).__name__}: {detail}") from exc
    info = export_info(step, int(state.get("version", 0)), f"rlcore export of {run} step {step}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    return write_dir(dest, engine.save_hf, info)
