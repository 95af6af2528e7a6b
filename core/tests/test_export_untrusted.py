"""Issue 38, items 2 and 3 (and 7's file modes): a run directory is data, never code, and the
model that leaves a run is the one that was trained.

* ``rlcore export`` of a run someone sent, run as docs/tasks.md runs a task (``PYTHONPATH=.``,
  the current directory the run), imports nothing from it: not the task or reward module its
  ``config.yaml`` names, not a module that shadows a library, not a ``*.dist-info`` entry point;
* ``RUN/model`` is linked from the last checkpoint's HF copy only when that copy is what was
  written; a damaged copy fails the run in one line, ``RUN/model`` then written from the trainer;
* ``rlcore export`` refuses a config that changes what the weights mean, naming the keys;
* full disks, ``--out`` under a file, in ``/proc``, in a read-only run: one line, exit 2;
  no message suggests deleting ``/``;
* exported files have the umask's modes (0644), not safetensors' private 0600.

One tiny run of two steps (a checkpoint after each) is shared by the module; each test works on
a copy of it when it changes files.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from rlcore import export as export_mod
from rlcore import trainer as trainer_mod
from rlcore.cli import main
from rlcore.errors import CheckpointError, RunOutputError
from rlcore.run_output import checkpoint_hf_dir, prepare_output_dir
from rlcore.stack import load_stack
from rlcore.testing.models import assert_same_tensors, model_dir_tensors
from rlcore.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "tiny.yaml")
SMALL = ["training.steps=2", "output.checkpoint_every=1", "rollout.n=4", "data.prompts_per_step=4",
         "output.tensorboard=false", "output.progress=false", "output.plot=false", "training.lr=0.01"]
RLCORE = str(Path(sys.executable).with_name("rlcore"))

#: the task module of the run: a real task (the successor task), which also leaves a marker
#: file whenever it is imported and the environment names one. Training imports it (it must);
#: nothing that reads the finished run may.
TASK_MODULE = textwrap.dedent("""
    import os
    from pathlib import Path

    from rlcore.tasks import successor, successor_reward

    if os.environ.get("RLCORE_TEST_MARKER_DIR"):
        Path(os.environ["RLCORE_TEST_MARKER_DIR"], "task-module-ran").write_text("imported")


    def task(data):
        return successor(data)


    def reward(x):
        return successor_reward(x)
""")


def _marker_module(label: str) -> str:
    return textwrap.dedent(f"""
        import os
        from pathlib import Path

        Path(os.environ.get("RLCORE_TEST_MARKER_DIR", "."), "{label}-ran").write_text("imported")
        raise ImportError("a hostile module ran")
    """)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished run trained with the task module ``run_task`` (a file outside the run): (trainer, dir)."""
    base = tmp_path_factory.mktemp("untrusted")
    code = base / "code"
    code.mkdir()
    (code / "run_task.py").write_text(TASK_MODULE)
    out = base / "run"
    old_mask = os.umask(0o022)
    sys.path.insert(0, str(code))
    try:
        trainer = Trainer(load_stack(TINY, SMALL + [f"output.dir={out}", "data.task=run_task:task",
                                                    "data.reward=run_task:reward"]))
        summary = trainer.run()
    finally:
        sys.path.remove(str(code))
        sys.modules.pop("run_task", None)
        os.umask(old_mask)
    assert summary["completed"]
    return trainer, out


def _copy_run(out: Path, dest: Path) -> Path:
    shutil.copytree(out, dest, copy_function=shutil.copy2)
    (dest / "run.lock").unlink(missing_ok=True)
    return dest


def _edit_config(run_dir: Path, **changes) -> None:
    cfg = OmegaConf.load(run_dir / "config.yaml")
    for key, value in changes.items():
        OmegaConf.update(cfg, key, value, merge=False)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))


#: the sources this test imports rlcore from: the subprocesses run the same (e.g. an old checkout)
SRC = str(Path(export_mod.__file__).resolve().parents[1])


def _cli(args: list[str], cwd: Path, env_extra: dict[str, str], timeout: int = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RLCORE_", "PYTHONPATH"))}
    env.update(env_extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), SRC]))
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------------------ item 2: runs nothing ----

def _plant(hostile: Path, vector: str) -> None:
    if vector == "the task module its config names":
        (hostile / "run_task.py").write_text(TASK_MODULE)
        return
    # the task, importable and harmless: the old code gets past it to the vector under test
    (hostile / "run_task.py").write_text(TASK_MODULE.replace('os.environ.get("RLCORE_TEST_MARKER_DIR")', "False"))
    if vector == "a module shadowing a library":
        (hostile / "safetensors.py").write_text(_marker_module("shadowing-module"))
    else:  # a forged rlcore distribution whose entry points name a module of the directory
        (hostile / "evil_plugin.py").write_text(_marker_module("entry-point-module"))
        dist = hostile / "rlcore-99.0.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: rlcore\nVersion: 99.0\n")
        (dist / "entry_points.txt").write_text("[rlcore]\nhf = evil_plugin\nlocal = evil_plugin\n")


@pytest.mark.parametrize("vector", ["the task module its config names", "a module shadowing a library",
                                    "a forged distribution"])
def test_export_of_a_hostile_run_directory_imports_nothing_from_it(run, tmp_path, vector):
    """The run a stranger sent holds code (``vector``). Exported with the current directory the run
    and ``PYTHONPATH=.`` (as docs/tasks.md runs a task), none of it runs, and the export is the
    checkpoint's weights."""
    _, out = run
    hostile = _copy_run(out, tmp_path / "sent")
    _plant(hostile, vector)
    markers = tmp_path / "markers"
    markers.mkdir()
    done = _cli([RLCORE, "export", ".", "--out", str(tmp_path / "exported")], cwd=hostile,
                env_extra={"PYTHONPATH": ".", "RLCORE_TEST_MARKER_DIR": str(markers)})
    assert sorted(p.name for p in markers.iterdir()) == [], (done.stdout, done.stderr)
    assert done.returncode == 0, done.stderr
    assert_same_tensors(model_dir_tensors(tmp_path / "exported"), model_dir_tensors(checkpoint_hf_dir(out, 1)))


def test_an_import_of_a_file_in_the_run_is_refused_while_it_is_read(run, tmp_path, monkeypatch):
    """The guard as a class: while a run is read, its directory is off ``sys.path`` and an import
    of any file inside it (a module or a package, found through any path entry) fails naming it."""
    _, out = run
    hostile = _copy_run(out, tmp_path / "sent")
    (hostile / "inside_mod.py").write_text("VALUE = 1\n")
    (hostile / "inside_pkg").mkdir()
    (hostile / "inside_pkg" / "__init__.py").write_text("VALUE = 2\n")
    monkeypatch.syspath_prepend(str(hostile))
    monkeypatch.syspath_prepend(str(tmp_path))  # the run's parent: ``import sent.inside_mod`` finds it
    with export_mod.reading_untrusted_run(hostile):
        assert not [e for e in sys.path if Path(e).resolve() == hostile.resolve()]
        for name in ("inside_mod", "inside_pkg", "sent", "sent.inside_mod"):
            with pytest.raises(ImportError):
                __import__(name)
    for name in ("inside_mod", "inside_pkg", "sent", "sent.inside_mod"):
        assert name not in sys.modules, name
    assert str(hostile) in sys.path, "sys.path is restored afterwards"


def test_export_builds_a_tiny_model_without_its_task(run, tmp_path):
    """The task module is gone (the run came without it): the export still works, from the
    vocabulary in the run's tokenizer.json; without any tokenizer it is one line naming them."""
    _, out = run
    copy = _copy_run(out, tmp_path / "run")
    assert main(["export", str(copy), "--step", "1", "--out", str(tmp_path / "e")]) == 0
    assert_same_tensors(model_dir_tensors(tmp_path / "e"), model_dir_tensors(checkpoint_hf_dir(out, 1)))
    assert (tmp_path / "e" / "tokenizer.json").read_text() == (checkpoint_hf_dir(out, 1) / "tokenizer.json").read_text()
    for d in (checkpoint_hf_dir(copy, 1), copy / "policy_hf", copy / "model"):
        (d / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="vocabulary") as exc:
        export_mod.export_checkpoint(copy, 1, tmp_path / "f")
    assert "data.task" in str(exc.value) and "\n" not in str(exc.value)
    assert not (tmp_path / "f").exists() and not (tmp_path / ".f.tmp").exists()


# ---------------------------------------------------- item 3: the exported model is the trained one ----

@pytest.mark.parametrize("damage", ["truncated", "one byte flipped"])
def test_a_damaged_checkpoint_copy_is_never_linked_into_run_model(tmp_path, monkeypatch, damage):
    """The last checkpoint's HF copy is damaged between the checkpoint and the end of the run: the
    run fails in one line naming the copy, and RUN/model holds the trainer's weights, loadable."""
    real = trainer_mod.export_policy

    def damage_then_export(trainer, final, step, *, at_checkpoint):
        if not at_checkpoint:
            f = checkpoint_hf_dir(trainer.out, step) / "model.safetensors"
            data = bytearray(f.read_bytes())
            if damage == "truncated":
                data = data[: len(data) // 2]
            else:
                data[-5] ^= 0x40  # inside the last tensor: the header still opens
            f.write_bytes(bytes(data))
        return real(trainer, final, step, at_checkpoint=at_checkpoint)

    monkeypatch.setattr(trainer_mod, "export_policy", damage_then_export)
    out = tmp_path / "run"
    trainer = Trainer(load_stack(TINY, SMALL + [f"output.dir={out}"]))
    with pytest.raises(CheckpointError) as exc:
        trainer.run()
    msg = str(exc.value)
    assert "\n" not in msg and "damaged" in msg and "step-00000001-hf" in msg, msg
    final = {name: t.detach().cpu() for name, t in trainer.engine.export_hf_weights()}
    assert_same_tensors(model_dir_tensors(out / "model"), final)
    assert export_mod.verify_export_dir(out / "model") is None
    assert os.stat(out / "model" / "model.safetensors").st_nlink == 1, "written, not linked to the damaged copy"


def test_every_export_records_its_files_and_a_changed_file_is_found(run, tmp_path):
    _, out = run
    for d in (out / "model", checkpoint_hf_dir(out, 0), checkpoint_hf_dir(out, 1)):
        assert export_mod.verify_export_dir(d) is None, d
        assert "model.safetensors" in json.loads((d / "rlcore_export.json").read_text())["files"]
    copy = _copy_run(out, tmp_path / "run")
    (copy / "model" / "config.json").write_text((copy / "model" / "config.json").read_text().replace("1e-06", "1e-05"))
    assert "config.json" in export_mod.verify_export_dir(copy / "model")
    (copy / "model" / "extra.safetensors").write_bytes((copy / "model" / "model.safetensors").read_bytes())
    (copy / "model" / "config.json").write_text((out / "model" / "config.json").read_text())
    assert "extra.safetensors" in export_mod.verify_export_dir(copy / "model")


@pytest.mark.parametrize("key, value", [
    ("engine.model.tiny.tie_word_embeddings", True),  # an architecture flag
    ("engine.model.dtype", "bfloat16"),  # silently lost precision before
    ("data.task", "rlcore.tasks:tool_product"),  # a tiny model's vocabulary
])
def test_export_refuses_a_config_that_changes_what_the_weights_mean(run, tmp_path, capsys, key, value):
    _, out = run
    copy = _copy_run(out, tmp_path / "run")
    saved = OmegaConf.select(OmegaConf.load(copy / "config.yaml"), key)
    _edit_config(copy, **{key: value})
    assert main(["export", str(copy), "--out", str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlcore: error: ") and err.count("\n") == 1, err
    assert key in err and "--allow-config-change" in err, err
    assert not (tmp_path / "e").exists() and not (tmp_path / ".e.tmp").exists()
    # the recorded value as an override: exported, and equal to the run's own copy
    assert main(["export", str(copy), f"{key}={saved}", "--out", str(tmp_path / "e")]) == 0
    assert_same_tensors(model_dir_tensors(tmp_path / "e"), model_dir_tensors(checkpoint_hf_dir(out, 1)))


def test_export_accepts_training_only_changes_and_says_what_it_accepted(run, tmp_path, capsys):
    _, out = run
    copy = _copy_run(out, tmp_path / "run")
    _edit_config(copy, **{"training.lr": 0.5, "algorithm.kl_coef": 0.3})  # do not change what weights mean
    assert main(["export", str(copy), "--out", str(tmp_path / "e")]) == 0
    assert_same_tensors(model_dir_tensors(tmp_path / "e"), model_dir_tensors(checkpoint_hf_dir(out, 1)))
    _edit_config(copy, **{"engine.model.dtype": "float64"})
    assert main(["export", str(copy), "--out", str(tmp_path / "f"), "--allow-config-change"]) == 0
    assert "rlcore: note: --allow-config-change: engine.model.dtype: 'float32' -> 'float64'" in capsys.readouterr().err


def test_exported_files_have_the_umasks_modes(run, tmp_path):
    _, out = run
    for d in (out / "model", checkpoint_hf_dir(out, 1)):
        modes = {p.name: oct(p.stat().st_mode & 0o777) for p in d.iterdir()}
        assert set(modes.values()) == {"0o644"}, (d, modes)
    old = os.umask(0o027)
    try:
        assert main(["export", str(out), "--out", str(tmp_path / "e")]) == 0
    finally:
        os.umask(old)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "e").iterdir()}
    assert set(modes.values()) == {"0o640"}, modes


# ------------------------------------------------------------ bad targets, one line each ----

def test_bad_out_targets_are_one_line_errors(run, tmp_path, capsys):
    _, out = run
    (tmp_path / "a-file").write_text("x")
    for target, words in [(tmp_path / "a-file" / "model", "not a directory"),
                          (Path("/proc/rlcore-export-test"), "cannot write the export"),
                          (Path("/"), "exists"),
                          (tmp_path / "a-file", "exists")]:
        assert main(["export", str(out), "--out", str(target)]) == 2, target
        err = capsys.readouterr().err
        assert err.startswith("rlcore: error: ") and err.count("\n") == 1 and words in err, (target, err)
        assert "delete" not in err and "rm -r" not in err, err
    assert (tmp_path / "a-file").read_text() == "x"


def _can_mount() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt 2>/dev/null || "
                               "mount -t tmpfs -o size=64k tmpfs /tmp"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


needs_mount = pytest.mark.skipif(not _can_mount(), reason="no user namespace with mounts here (unshare -rm)")


@needs_mount
def test_a_full_disk_and_a_read_only_run_are_one_line_errors(run, tmp_path):
    """A real full disk (a 300 KiB tmpfs, the weights are 1.2 MB) and a real read-only run
    (a read-only bind mount), in a mount namespace of the test's own."""
    _, out = run
    copy = _copy_run(out, tmp_path / "run")
    full = tmp_path / "full"
    full.mkdir()
    script = (f"mount -t tmpfs -o size=300k tmpfs {full} && {RLCORE} export {copy} --out {full}/model; "
              f"echo rc=$?; ls -A {full}")
    done = _cli(["unshare", "-rm", "sh", "-c", script], cwd=tmp_path, env_extra={})
    lines = done.stderr.strip().splitlines()
    assert "rc=2" in done.stdout and done.stdout.split("rc=2")[1].strip() == "", done.stdout  # nothing left
    assert len(lines) == 1 and lines[0].startswith("rlcore: error: cannot write the export"), done.stderr
    assert "No space left on device" in lines[0], lines[0]

    script = (f"mount --bind {copy} {copy} && mount -o remount,ro,bind {copy} && {RLCORE} export {copy}; "
              f"echo rc=$?")
    done = _cli(["unshare", "-rm", "sh", "-c", script], cwd=tmp_path, env_extra={})
    lines = done.stderr.strip().splitlines()
    assert "rc=2" in done.stdout, (done.stdout, done.stderr)
    assert len(lines) == 1 and "Read-only file system" in lines[0] and "--out" in lines[0], done.stderr
    assert not (copy / "export-step-1").exists()


# ------------------------------------------------------- refusal messages never say "delete /" ----

@pytest.mark.parametrize("where", ["root", "home", "parent of the current directory"])
def test_no_refusal_suggests_deleting_an_important_directory(tmp_path, monkeypatch, where):
    """``--output`` at ``/``, ``$HOME``, or a directory that holds the current one, even one that
    carries rlcore's run marker: every refusal is one line and none suggests deleting it;
    ``--overwrite`` clears nothing there."""
    if where == "root":
        target = Path("/")
    else:
        home = tmp_path / "home"
        (home / "work").mkdir(parents=True)
        (home / "notes.txt").write_text("mine")
        (home / "run.json").write_text(json.dumps({"rlcore_run": 1}))  # even a forged marker
        monkeypatch.setenv("HOME", str(home))
        target = home
        if where != "home":
            monkeypatch.setenv("HOME", str(tmp_path / "elsewhere"))
            monkeypatch.chdir(home / "work")
    for flags in ({"resume": False, "overwrite": False}, {"resume": False, "overwrite": True},
                  {"resume": True, "overwrite": False}):
        with pytest.raises(RunOutputError) as exc:
            prepare_output_dir(target, **flags)
        msg = str(exc.value)
        assert "\n" not in msg and "rm -r" not in msg and "--overwrite (deletes" not in msg, msg
        assert "--overwrite to delete" not in msg, msg
    if where != "root":
        assert (target / "notes.txt").read_text() == "mine"
