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

**A run directory is data, never code.** A run someone sent may name any module in its
``config.yaml`` (``data.task``, ``data.reward``) and hold any file. ``rlcore export`` imports none
of them: the tiny model's vocabulary comes from the run's own ``tokenizer.json`` (a word list, not
the task function), and while a run is read (:func:`reading_untrusted_run`) the run directory is
off ``sys.path`` (no module and no ``*.dist-info`` entry point found there) and any import that
would load a file inside it is refused. Python's standard library and rlcore itself are imported
before rlcore sees the run: never put an untrusted directory on ``PYTHONPATH``.

**What was trained is what is exported.** Every directory :func:`commit_dir` writes records the
size and sha256 of each of its files in ``rlcore_export.json`` and is committed only when each
safetensors file's header opens; its files get the mode a new file gets under the umask (0644
with the usual 022). The end of a run hard-links the last checkpoint's copy into ``RUN/model``
only after that copy matches its record (:func:`verify_export_dir`); a damaged copy is not
linked: ``RUN/model`` is written from the trainer's weights and the run fails naming the copy.
``rlcore export`` refuses a ``config.yaml`` (or overrides) that differs from the config recorded in
the checkpoint in a key that changes what the weights mean (:func:`weight_meaning_diffs`), unless
``allow_config_change``.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import importlib.abc
import importlib.machinery
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from rlcore.errors import CheckpointError, RLCoreError, RunOutputError
from rlcore.lora import MERGED_DIR

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


def _umask() -> int:
    try:  # Linux: read it without changing it (os.umask sets it, racing other threads)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _give_default_modes(d: Path) -> None:
    """The modes a newly created file and directory get under the umask (0644 and 0755 with the
    usual 022): safetensors writes through a private temporary file, which left the weights 0600."""
    mask = _umask()
    for p in [d, *d.rglob("*")]:
        if p.is_symlink():
            continue
        with contextlib.suppress(OSError):  # a file system without modes (vfat): nothing to give
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


def _sha256_file(path: Path) -> str:
    from rlcore.run_output import sha256_file  # the checkpoints' own checksum, one implementation

    return sha256_file(path)


def _manifest(d: Path) -> dict[str, dict[str, Any]]:
    """``{relative path: {"bytes", "sha256"}}`` of every file of an export but its info file."""
    return {p.relative_to(d).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256_file(p)}
            for p in sorted(d.rglob("*")) if p.is_file() and not p.is_symlink() and p.name != EXPORT_INFO}


def check_safetensors(path: Path) -> str | None:
    """Why the safetensors file ``path`` cannot be loaded (its header unreadable, a tensor outside
    the file, bytes not covered), or ``None`` when it opens; reads the header only."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError: the reason is what matters
        text = " ".join(str(exc).split()) or type(exc).__name__
        return f"{type(exc).__name__}: {text[:200]}"
    return None


def _check_weights_load(d: Path) -> None:
    files = sorted(d.rglob("*.safetensors"))
    for f in files:
        why = check_safetensors(f)
        if why is not None:
            raise RunOutputError(f"the export {f} does not load ({why})")


def verify_export_dir(d: Path, info: dict[str, Any] | None = None) -> str | None:
    """Why the export directory ``d`` is not what was written into it (a file missing, of another
    size or sha256 than its ``rlcore_export.json`` records, a weights file that does not load, a
    weights file it does not record), or ``None`` when it is whole."""
    d = Path(d)
    info = info if info is not None else read_export_info(d)
    files = info.get("files") if isinstance(info, dict) else None
    if not isinstance(files, dict) or not files:
        return f"{d / EXPORT_INFO} records no file checksums (written by an older rlcore, or damaged)"
    for name, want in sorted(files.items()):
        p = d / name
        try:
            if not p.is_file() or p.is_symlink():
                return f"{p} is missing"
            if p.stat().st_size != int(want["bytes"]):
                return f"{p} has {p.stat().st_size} bytes, {int(want['bytes'])} were written"
            if _sha256_file(p) != str(want["sha256"]):
                return f"{p} differs from what was written (sha256)"
        except (OSError, KeyError, TypeError, ValueError) as exc:
            return f"{p} cannot be checked: {type(exc).__name__}: {exc}"
    for p in sorted(d.rglob("*.safetensors")):
        if p.relative_to(d).as_posix() not in files:
            return f"{p} was not written with the export"
        why = check_safetensors(p)
        if why is not None:
            return f"{p} does not load ({why})"
    return None


def commit_dir(staging: Path, final: Path, info: dict[str, Any]) -> Path:
    """Write ``info`` (with the size and sha256 of every file: ``files``) into ``staging``, check
    that its weights load, give its files the umask's modes, make it durable and give it the name
    ``final`` (replacing an older ``final`` atomically)."""
    staging, final = Path(staging), Path(final)
    (staging / EXPORT_INFO).unlink(missing_ok=True)  # never write through a hard link (link_or_copy_dir)
    _check_weights_load(staging)
    _give_default_modes(staging)
    info = dict(info, files=_manifest(staging))
    (staging / EXPORT_INFO).write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
    with contextlib.suppress(OSError):
        os.chmod(staging / EXPORT_INFO, 0o666 & ~_umask())
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


def link_or_copy_dir(src: Path, dest: Path, names: Sequence[str] | None = None) -> None:
    """Fill ``dest`` with ``src``'s files (``names``, relative paths: only those) as hard links (no
    second copy of the weights on disk; safe because an export is never modified in place, only
    replaced), copies where the file system has no hard links."""
    chosen = None if names is None else set(names)
    for p in sorted(Path(src).rglob("*")):
        if p.name == EXPORT_INFO:
            continue  # the new directory gets its own
        rel = p.relative_to(src)
        target = dest / rel
        if p.is_dir():
            if chosen is None:
                target.mkdir(parents=True, exist_ok=True)
            continue
        if chosen is not None and rel.as_posix() not in chosen:
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
    damaged: list[str] = []

    def reuse() -> bool:
        held = read_export_info(same) if same is not None else None
        if not held or held.get("step") != step or held.get("weight_version") != trainer.version:
            return False
        why = verify_export_dir(same, held)
        if why is not None:  # never link a copy that is not what was written: write from the trainer
            if isinstance(held.get("files"), dict):  # an older rlcore's copy records none: not damaged
                damaged.append(why)
            return False
        link_or_copy_dir(same, staging, names=list(held["files"]))
        return True

    try:
        if not on_writer(ranks, reuse):
            trainer._write_policy_hf(staging)
            if trainer.cfg.lora.export_merged and trainer.cfg.lora.rank > 0:  # rlcore.lora: the merged model too
                on_writer(ranks, lambda: trainer.engine.save_merged(staging / MERGED_DIR))
        on_writer(ranks, lambda: commit_dir(staging, final, info))
    except BaseException as exc:  # a signal that stops the run at once, too: no staging directory left
        if ranks.writer:  # no collective here: the other ranks may not have failed
            shutil.rmtree(staging, ignore_errors=True)
        if not isinstance(exc, Exception) or isinstance(exc, RLCoreError):
            raise  # a signal, or an error that is one line already
        # a full disk: OSError, torch's RuntimeError, safetensors' SafetensorError (an Exception)
        raise CheckpointError(f"cannot write the Hugging Face export {final}: {_first_line(exc)}"
                              + ("; the checkpoint itself is committed" if at_checkpoint else "")) from exc
    if damaged:
        raise CheckpointError(
            f"the Hugging Face copy of checkpoint step {step} is damaged: {damaged[0]}; {final} was written from "
            f"the trainer's weights instead and is whole. Check the disk; rlcore export {trainer.out} --step {step} "
            f"--out DIR writes that checkpoint out again from its state file")


def _first_line(exc: BaseException) -> str:
    """An exception in one line; a failed write names its ``OSError`` (torch and safetensors wrap it)."""
    seen: BaseException | None = exc
    while seen is not None and not isinstance(seen, OSError):
        seen = seen.__cause__ or seen.__context__
    if isinstance(seen, OSError) and seen.strerror:
        return seen.strerror + (f": {seen.filename}" if seen.filename else "")
    text = " ".join(str(exc).split())
    return text[:300] if text else type(exc).__name__


# ------------------------------------------------------------------ reading a run as data -----

class _RunDirImportGuard(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path`` while a run is read: an import that would load a file inside
    the run directory (through any ``sys.path`` entry, a parent's included) is refused."""

    def __init__(self, run: Path):
        self.run = run

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        where = [spec.origin] if spec.origin not in (None, "built-in", "frozen", "namespace") else []
        where += list(spec.submodule_search_locations or [])
        for w in where:
            if _inside(Path(w), self.run):
                raise ImportError(f"refusing to import {name!r} from {w}: it lies in the run directory {self.run}, "
                                  f"which rlcore reads as data and never runs code from")
        return None  # not ours to load: the normal finders go on


def _real(p: Path | str) -> Path:
    return Path(os.path.realpath(os.fspath(p) or "."))


def _inside(p: Path, root: Path) -> bool:
    p = _real(p)
    return p == root or root in p.parents


@contextlib.contextmanager
def reading_untrusted_run(run: str | Path) -> Iterator[None]:
    """While a run directory is read: no module, no package and no entry point (``*.dist-info``)
    is found in it. Its entries (``""``, ``.`` when the current directory is in the run, PYTHONPATH
    entries) leave ``sys.path``, and :class:`_RunDirImportGuard` refuses any import of a file
    inside it. Both are put back afterwards."""
    root = _real(run)
    saved = list(sys.path)
    sys.path[:] = [e for e in sys.path if not _inside(Path(e or "."), root)]
    guard = _RunDirImportGuard(root)
    sys.meta_path.insert(0, guard)
    importlib.invalidate_caches()
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(guard)
        sys.path[:] = saved + [e for e in sys.path if e not in saved]  # keep what was added meanwhile
        importlib.invalidate_caches()


# ------------------------------------------------------------------------- rlcore export -----

def load_checkpoint_of_step(run: Path, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The state and record of the committed checkpoint of ``step``, checked as ``--resume``
    checks it (record readable, size and sha256 of the state file, ``weights_only`` load)."""
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
    return state, record


class _VocabOnly:
    """What an engine factory needs of the task for a tiny model: its word list (``vocab``).
    Export never makes prompts; it has no task function to call."""

    def __init__(self, vocab: list[str], source: Path):
        self.name, self.vocab, self.source = f"vocabulary of {source}", vocab, source

    def make_prompts(self, rng: Any, count: int) -> Any:
        raise RuntimeError(f"rlcore export makes no prompts (the {self.name} stands in for data.task)")


def tiny_vocab_of_run(run: Path, step: int) -> _VocabOnly:
    """The word list of a tiny model's tokenizer as the run saved it (``tokenizer.json`` of the
    checkpoint's own HF copy, else ``policy_hf/``, else ``model/``): the vocabulary the task gave
    the run, read as data (rlcore export never imports the task)."""
    from rlcore.engines.tiny import SPECIAL_TOKENS
    from rlcore.run_output import checkpoint_hf_dir

    tried = []
    for d in (checkpoint_hf_dir(run, step), run / "policy_hf", run / MODEL_DIR):
        path = d / "tokenizer.json"
        tried.append(str(path))
        try:
            model = json.loads(path.read_text()).get("model", {})
            vocab = model.get("vocab") if model.get("type") == "WordLevel" else None
            if not isinstance(vocab, dict) or not all(isinstance(w, str) and type(i) is int for w, i in vocab.items()):
                continue
        except (OSError, ValueError, AttributeError):
            continue
        words = sorted(vocab, key=vocab.get)
        if [vocab[w] for w in words] != list(range(len(words))) or tuple(words[:len(SPECIAL_TOKENS)]) != SPECIAL_TOKENS:
            continue
        return _VocabOnly(words[len(SPECIAL_TOKENS):], path)
    raise CheckpointError(
        f"cannot rebuild the tiny model's vocabulary of {run}: none of {', '.join(tried)} is a word-level "
        f"tokenizer an rlcore run wrote (rlcore export reads it there and never imports the run's data.task)")


def build_engine(stack: Any, task: Any = None) -> Any:
    """The training engine of ``stack``, built as the trainer builds it (platform, the engine
    plugin's section, ``task``: what the factory reads a tiny model's vocabulary from) without
    rollout, sync or optimizer. ``task=None`` imports and calls ``data.task``: trusted configs only."""
    import random

    import torch

    from rlcore.platforms import resolve_device
    from rlcore.types import BuildContext

    cfg = stack.config
    torch.manual_seed(cfg.training.seed)  # a tiny model is created before the checkpoint lands in it
    random.seed(cfg.training.seed)
    if task is None:
        from rlcore.tasks import load_callable

        task = load_callable(cfg.data.task, "data.task")(cfg.data)
    sections = {ps.plugin: ps.section for ps in stack.plugins.plugin_settings()}

    def ctx(spec: Any, **kw: Any) -> BuildContext:
        section = sections.get(spec.plugin)
        return BuildContext(config=cfg, settings=cfg[section] if section else None, extras={"task": task}, **kw)

    platform_ctx = ctx(stack.platform) if stack.platform is not None else BuildContext(config=cfg)
    resolved = resolve_device(cfg.engine.device, ctx=platform_ctx, spec=stack.platform)
    return stack.engine.factory(ctx(stack.engine, device=resolved.device, platform=resolved.platform))


def weight_meaning_diffs(saved: Any, stack: Any) -> list[str]:
    """``key: saved -> current`` for each key of the checkpoint's recorded config (its
    fingerprint) that ``stack``'s config changes and that changes what the weights mean when the
    engine is rebuilt from it: the engine (model path, dtype, architecture, ...: ``engine.*``), the
    engine plugin's section and, for a tiny model, ``data.task`` (its vocabulary). Keys of training only (``training.lr``) do not matter to an export."""
    from rlcore.config import training_fingerprint
    from rlcore.run_output import _config_diffs

    cfg = stack.config
    sections = {ps.plugin: ps.section for ps in stack.plugins.plugin_settings()}
    prefixes = ["engine."] + ([f"{sections[stack.engine.plugin]}."] if sections.get(stack.engine.plugin) else [])
    # not ``plugins``: they pick providers (a kernel, a rollout); the model is the engine's and its section's
    exact = {"data.task"} if not cfg.engine.model.path else set()
    current = training_fingerprint(cfg, stack.plugins.plugin_settings())
    if not isinstance(saved, dict):
        return ["(the checkpoint records no config)"]
    diffs = _config_diffs(saved, current)
    return [d for d in diffs if (k := d.split(":", 1)[0]) in exact or k.startswith(tuple(prefixes))]


def _export_target(run: Path, step: int, out: str | Path | None) -> Path:
    """Where the export goes, checked before anything is loaded: one line for a target that
    exists, lies under a file, or cannot be created (``/proc``, a read-only run directory)."""
    dest = Path(out) if out is not None else run / f"export-step-{step}"
    flag = "--out" if out is not None else "the default --out (RUN/export-step-N)"
    if dest.exists() or dest.is_symlink():
        raise RunOutputError(f"output {dest} exists: an export never writes into an existing path; give another --out")
    for parent in dest.parents:
        if parent.exists():
            if not parent.is_dir():
                raise RunOutputError(f"cannot write the export to {dest} ({flag}): {parent} is not a directory")
            break
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        begin_dir(dest)  # proves the directory takes new entries; removed again if the export fails
    except OSError as exc:
        hint = " (the run directory is not writable: pass --out elsewhere)" if out is None else ""
        raise RunOutputError(f"cannot write the export to {dest} ({flag}): {_first_line(exc)}{hint}") from exc
    return dest


def export_checkpoint(run: str | Path, step: int | None = None, out: str | Path | None = None,
                      overrides: Sequence[str] = (), *, allow_config_change: bool = False,
                      on_note: Callable[[str], None] | None = None) -> Path:
    """Write the policy of the checkpoint of ``step`` (default: the newest) of ``run`` as a Hugging
    Face directory at ``out`` (default ``RUN/export-step-N``); returns ``out``. ``overrides``:
    dotlist changes to the saved config (``engine.device=cpu`` to export a GPU run on a CPU).

    The run is read as data (:func:`reading_untrusted_run`): nothing in it is imported, the task
    and reward it names are not loaded. A config (``config.yaml`` with ``overrides``) that differs
    from the checkpoint's recorded one in a key that changes what the weights mean is refused
    naming the keys, unless ``allow_config_change`` (then each difference goes to ``on_note``)."""
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
    with reading_untrusted_run(run):
        dest = _export_target(run, step, out)
        staging = staging_dir(dest)
        try:
            state, record = load_checkpoint_of_step(run, step)
            stack = load_stack(config, overrides)
            diffs = weight_meaning_diffs(record.get("config"), stack)
            if diffs and not allow_config_change:
                shown = "; ".join(diffs[:8]) + (f"; and {len(diffs) - 8} more" if len(diffs) > 8 else "")
                raise CheckpointError(
                    f"{config}{' with the overrides' if overrides else ''} differs from the config checkpoint step "
                    f"{step} was written with, in keys that change what its weights mean: {shown}. Export with the "
                    f"recorded values (as overrides, e.g. {diffs[0].split(':', 1)[0]}=...), or pass "
                    f"--allow-config-change to export anyway")
            for d in diffs:
                if on_note is not None:
                    on_note(f"--allow-config-change: {d}")
            quiet_transformers()
            vocab = tiny_vocab_of_run(run, step) if not stack.config.engine.model.path else _VocabOnly([], config)
            engine = build_engine(stack, task=vocab)
            try:
                engine.load_state_dict(state["engine"])
            except (KeyError, TypeError, ValueError, RuntimeError) as exc:
                detail = " ".join(ln.strip() for ln in str(exc).splitlines() if ln.strip())[:300]
                raise CheckpointError(f"checkpoint of step {step} does not fit the engine of {config}: "
                                      f"{type(exc).__name__}: {detail}") from exc
            info = export_info(step, int(state.get("version", 0)), f"rlcore export of {run} step {step}")
            try:
                engine.save_hf(staging)
                if stack.config.lora.export_merged and stack.config.lora.rank > 0:
                    engine.save_merged(staging / MERGED_DIR)
                return commit_dir(staging, dest, info)
            except RLCoreError:
                raise
            except Exception as exc:  # a full disk, a file-size limit: SafetensorError, RuntimeError, OSError
                raise RunOutputError(f"cannot write the export to {dest}: {_first_line(exc)}") from exc
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
