"""Run output: one run per directory, atomic kept checkpoints loaded safely, NaN-visible metrics."""

import json
import math
import os
import pickle
import re
import subprocess
import sys

import pytest
import torch
from rlcore.config import fingerprint_diff
from rlcore.errors import CheckpointError, RLCoreError, RunOutputError
from rlcore.run_output import (
    CHECKPOINT_DIR,
    RUN_MARKER,
    MetricsWriter,
    sha256_file,
    checkpoint_hf_dir,
    list_checkpoints,
    load_checkpoint,
    prepare_output_dir,
    prune_checkpoints,
    read_metrics,
    save_checkpoint,
)

LOCK_FILE = "run.lock"  # rlcore.run_lock.LOCK_FILE
CFG = {"training.lr": 0.001, "algorithm.kl_coef": 0.0}


def _state(step):
    return {"engine": {"model": {"w": torch.full((3,), float(step))}}, "step": step, "python_rng": (3, (1, 2), None)}


def _save(out, step, keep=3, cfg=CFG):
    return save_checkpoint(out, _state(step), {"step": step, "config": cfg}, keep=keep)


# ------------------------------------------------------------------------------ output dir ----

def test_new_run_refuses_a_non_empty_directory_and_names_the_flags(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(RunOutputError, match=r"not empty \(metrics.jsonl\).*--resume.*--overwrite"):
        prepare_output_dir(tmp_path, resume=False, overwrite=False)
    assert (tmp_path / "metrics.jsonl").exists()


def _tree(d):
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


def test_overwrite_clears_an_rlcore_run_but_never_another_directory(tmp_path):
    run = tmp_path / "run"
    prepare_output_dir(run, resume=False, overwrite=False).release()  # a new run: marked as rlcore's
    (run / "checkpoints").mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    prepare_output_dir(run, resume=False, overwrite=True).release()
    assert _tree(run) == sorted([LOCK_FILE, RUN_MARKER]), "cleared, then marked again for the new run"
    assert json.loads((run / RUN_MARKER).read_text())["rlcore_run"] == 1

    other = tmp_path / "home"
    other.mkdir()
    (other / "thesis.tex").write_text("precious")
    with pytest.raises(RunOutputError, match="not an rlcore run directory.*refusing"):
        prepare_output_dir(other, resume=False, overwrite=True)
    assert _tree(other) == ["thesis.tex"]


@pytest.mark.parametrize("marker", [None, '{"name": "my project"}', "not json", '{"rlcore_run": "yes"}'])
def test_overwrite_never_deletes_a_directory_without_rlcore_marker(tmp_path, marker):
    """A home directory that happens to hold checkpoints/, a checkpoint file and metrics.jsonl
    (or a run.json of its own) was wiped by --overwrite: only rlcore's marker counts."""
    home = tmp_path / "home"
    (home / "checkpoints").mkdir(parents=True)
    (home / "checkpoints" / "model.pt").write_bytes(b"mine")
    (home / "checkpoint").write_text("mine")
    (home / "metrics.jsonl").write_text('{"step": 0}\n')
    (home / ".bashrc").write_text("export PATH")
    if marker is not None:
        (home / RUN_MARKER).write_text(marker)
    before = _tree(home)
    with pytest.raises(RunOutputError, match=r"not an rlcore run directory \(no rlcore run.json;.*refusing to "
                                             r"delete it.*rm -r"):
        prepare_output_dir(home, resume=False, overwrite=True)
    assert _tree(home) == before and (home / "checkpoints" / "model.pt").read_bytes() == b"mine"


_HOLDER = """
import sys, time
from rlcore.run_output import prepare_output_dir
hold = prepare_output_dir(sys.argv[1], resume=sys.argv[2] == "resume", overwrite=False)
print("holding", flush=True)
time.sleep(300)
"""


def _holder(out, mode):
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(out), mode], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "holding"
    return proc


def test_a_second_process_on_a_run_directory_is_refused_naming_the_holder(tmp_path):
    out = tmp_path / "run"
    _save(out, 1)
    first = _holder(out, "resume")
    try:
        for resume, overwrite in [(True, False), (False, False), (False, True)]:
            with pytest.raises(RunOutputError, match=rf"in use by another rlcore process \(pid {first.pid}\b"):
                prepare_output_dir(out, resume=resume, overwrite=overwrite)
        assert [s for s, _ in list_checkpoints(out)] == [1], "nothing was deleted"
    finally:
        first.kill()
        first.wait()
    # the lock died with its holder: no stale lock to clear by hand
    prepare_output_dir(out, resume=True, overwrite=False).release()


def test_a_new_run_in_a_directory_another_process_just_took_is_refused(tmp_path):
    out = tmp_path / "run"
    first = _holder(out, "new")
    try:
        with pytest.raises(RunOutputError, match=rf"pid {first.pid}\b"):
            prepare_output_dir(out, resume=False, overwrite=True)
    finally:
        first.kill()
        first.wait()
    assert _tree(out) == sorted([LOCK_FILE, RUN_MARKER])


def test_a_failed_start_removes_only_what_it_created(tmp_path):
    parent = tmp_path / "a"
    hold = prepare_output_dir(parent / "b" / "run", resume=False, overwrite=False)
    (parent / "b" / "run" / "metrics.jsonl").write_text('{"step": 0}\n')
    hold.abandon()
    assert not parent.exists(), "every directory this start created is gone"

    empty = tmp_path / "empty"
    empty.mkdir()
    hold = prepare_output_dir(empty, resume=False, overwrite=False)
    (empty / "tensorboard").mkdir()
    hold.abandon()
    assert empty.is_dir() and _tree(empty) == [], "a directory that was there stays, emptied of what the start wrote"

    _save(tmp_path / "old", 1)
    hold = prepare_output_dir(tmp_path / "old", resume=True, overwrite=False)
    hold.abandon()
    assert [s for s, _ in list_checkpoints(tmp_path / "old")] == [1], "a --resume start never deletes anything"
    prepare_output_dir(tmp_path / "old", resume=True, overwrite=False).release()  # and the lock is free


def test_resume_needs_a_checkpoint(tmp_path):
    with pytest.raises(RunOutputError, match="nothing to resume"):
        prepare_output_dir(tmp_path / "absent", resume=True, overwrite=False)
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(RunOutputError, match="no complete checkpoint"):
        prepare_output_dir(tmp_path, resume=True, overwrite=False)
    with pytest.raises(RunOutputError, match="contradict"):
        prepare_output_dir(tmp_path, resume=True, overwrite=True)
    _save(tmp_path, 3)
    prepare_output_dir(tmp_path, resume=True, overwrite=False)  # now fine


# ---------------------------------------------------------------------------- checkpoints ----

def test_checkpoints_are_committed_by_their_record_and_the_newest_k_kept(tmp_path):
    for step in range(5):
        _save(tmp_path, step, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 4]
    assert sorted(p.name for p in (tmp_path / CHECKPOINT_DIR).iterdir()) == [
        "step-00000003.json", "step-00000003.pt", "step-00000004.json", "step-00000004.pt"]
    state, record, diffs = load_checkpoint(tmp_path, CFG)
    assert state["step"] == 4 and record["step"] == 4 and diffs == []
    assert torch.equal(state["engine"]["model"]["w"], torch.full((3,), 4.0))
    assert record["state_sha256"] == sha256_file(tmp_path / CHECKPOINT_DIR / "step-00000004.pt")


def test_interrupted_writes_leave_the_previous_checkpoint_loadable(tmp_path):
    _save(tmp_path, 1)
    d = tmp_path / CHECKPOINT_DIR
    # a kill between the state write and the rename, and one between the rename and the record
    (d / ".step-00000002.pt.tmp").write_bytes(b"half a checkpoint")
    (d / "step-00000003.pt").write_bytes((d / "step-00000001.pt").read_bytes())
    state, record, _ = load_checkpoint(tmp_path, CFG)
    assert state["step"] == 1
    _save(tmp_path, 4)  # the next good write clears the leftovers
    assert sorted(p.name for p in d.iterdir()) == [
        "step-00000001.json", "step-00000001.pt", "step-00000004.json", "step-00000004.pt"]


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "record"])
def test_damaged_checkpoint_is_an_error_naming_the_file(tmp_path, damage):
    _save(tmp_path, 1)
    path = _save(tmp_path, 2)
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        path.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    elif damage == "delete":
        path.unlink()
    else:
        path.with_suffix(".json").write_text("{not json")
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path, CFG)
    msg = str(e.value)
    assert "step-00000002" in msg and "older checkpoints: step-00000001" in msg, msg


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_checkpoint_that_would_run_code_is_refused_without_running_it(tmp_path):
    """The record's sha256 matches (whoever wrote the file wrote the record too): safety comes
    from weights_only=True, not from the checksum."""
    marker = tmp_path / "pwned"
    path = _save(tmp_path, 1)
    torch.save({"engine": _RunsCode(str(marker)), "step": 1}, path)
    rec = path.with_suffix(".json")
    record = json.loads(rec.read_text())
    record.update(state_bytes=path.stat().st_size, state_sha256=sha256_file(path))
    rec.write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match=r"cannot load checkpoint .*step-00000001.pt safely"):
        load_checkpoint(tmp_path, CFG)
    assert not marker.exists()


def test_checkpoint_of_another_config_is_refused_naming_each_difference(tmp_path):
    _save(tmp_path, 1)
    other = dict(CFG, **{"training.lr": 0.01, "plugins": ["fused"]})
    with pytest.raises(CheckpointError, match=r"different config: plugins: \(absent\) -> \['fused'\]; "
                                              r"training.lr: 0.001 -> 0.01.*--allow-config-change"):
        load_checkpoint(tmp_path, other)
    state, _, diffs = load_checkpoint(tmp_path, other, allow_config_change=True)
    assert state["step"] == 1 and len(diffs) == 2
    assert fingerprint_diff({"a": 1}, {"a": 1}) == []


def test_checkpoint_write_failure_is_an_rlcore_error(tmp_path):
    (tmp_path / CHECKPOINT_DIR).write_text("a file where the directory should be")
    with pytest.raises(CheckpointError, match="cannot write checkpoint"):
        _save(tmp_path, 1)


def test_pruning_touches_only_rlcore_names(tmp_path):
    """best.pt and NOTES.txt in checkpoints/ were deleted by the pruning: only rlcore's own names
    (state, record, HF export, shards, their temporaries) are pruned, per step, together."""
    d = tmp_path / CHECKPOINT_DIR
    d.mkdir()
    user = ["best.pt", "NOTES.txt", "step-1.pt", "step-00000001.pt.bak", "step-00000001-hf-mine", "my-step-00000001.pt"]
    for name in user:
        (d / name).write_text("the user's")
    (d / "favourites").mkdir()
    (d / "favourites" / "step-00000001.pt").write_text("the user's")
    for step in range(4):
        hf = checkpoint_hf_dir(tmp_path, step)
        hf.mkdir()
        (hf / "model.safetensors").write_bytes(b"w")
        _save(tmp_path, step, keep=2)
    (d / ".step-00000009-hf.tmp-1234").mkdir()  # an export a kill interrupted
    (d / ".step-00000009.json.tmp").write_text("{")
    (d / "step-00000009.rank_0-of-2.pt").write_bytes(b"a shard without its record")
    prune_checkpoints(tmp_path, keep=2)
    assert _tree(d) == sorted(user + ["favourites", "favourites/step-00000001.pt",
                                      "step-00000002-hf", "step-00000002-hf/model.safetensors", "step-00000002.json",
                                      "step-00000002.pt", "step-00000003-hf", "step-00000003-hf/model.safetensors",
                                      "step-00000003.json", "step-00000003.pt"])
    assert all((d / name).read_text() == "the user's" for name in user)


#: run in a child process: RLIMIT_FSIZE limits every file the process writes, and pytest's own
#: output, redirected to a log file in CI, fails with EFBIG under it (an INTERNALERROR that ended
#: the suite). SIGXFSZ is ignored so that write() returns EFBIG instead of killing the child.
_SAVE_UNDER_LIMIT = """
import resource, signal, sys, torch
from rlcore.errors import CheckpointError
from rlcore.run_output import save_checkpoint
out, floats, limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    save_checkpoint(out, {"engine": {"model": {"w": torch.zeros(floats)}}, "step": 2},
                    {"step": 2, "config": {"training.lr": 0.001}}, keep=3)
except CheckpointError as exc:
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    print("CheckpointError:", exc)
    sys.exit(0)
print("no error")
sys.exit(1)
"""


@pytest.mark.parametrize("floats", [1 << 16, 1 << 10], ids=["torch-runtime-error", "oserror-at-flush"])
def test_a_checkpoint_that_does_not_fit_is_an_error_and_leaves_no_temporary(tmp_path, floats):
    """What a full disk does to a write (it fails part-way), as RLIMIT_FSIZE (works as root).
    torch.save raises a RuntimeError ("unexpected pos ...") when a write inside its zip writer
    fails, an OSError when the buffered tail fails at flush: both are the same CheckpointError."""
    _save(tmp_path, 1)
    size = (tmp_path / CHECKPOINT_DIR / "step-00000001.pt").stat().st_size
    # the committed checkpoint fits, the new one (4 bytes a float) not
    proc = subprocess.run([sys.executable, "-c", _SAVE_UNDER_LIMIT, str(tmp_path), str(floats),
                           str(max(size + 1, floats))], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert re.search(r"cannot write checkpoint .*step-00000002.pt: .*File too large.*older checkpoints are intact",
                     proc.stdout), proc.stdout
    assert _tree(tmp_path / CHECKPOINT_DIR) == ["step-00000001.json", "step-00000001.pt"]
    state, _, _ = load_checkpoint(tmp_path, CFG)
    assert state["step"] == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory (file permissions do not "
                                               "apply); the file-size-limit test covers the failure path")
def test_a_read_only_checkpoint_directory_is_an_error(tmp_path):
    _save(tmp_path, 1)
    d = tmp_path / CHECKPOINT_DIR
    d.chmod(0o555)
    try:
        with pytest.raises(CheckpointError, match=r"cannot write checkpoint .*step-00000002.pt: .*Permission denied"):
            _save(tmp_path, 2)
    finally:
        d.chmod(0o755)
    assert _tree(d) == ["step-00000001.json", "step-00000001.pt"]


def test_a_committed_checkpoint_is_never_rewritten(tmp_path):
    path = _save(tmp_path, 1)
    before = path.read_bytes(), path.with_suffix(".json").read_bytes()
    with pytest.raises(CheckpointError, match="step-00000001.* is already committed"):
        save_checkpoint(tmp_path, _state(5), {"step": 1, "config": CFG}, keep=3)
    assert (path.read_bytes(), path.with_suffix(".json").read_bytes()) == before


# -------------------------------------------------------------------------------- metrics ----

def test_metrics_keep_nan_visible_and_read_back(tmp_path):
    w = MetricsWriter(tmp_path)
    w.write({"step": 0, "loss": math.nan, "grad_norm": math.inf, "kl": -math.inf, "reward_mean": 0.5})
    line = (tmp_path / "metrics.jsonl").read_text()
    assert json.loads(line) == {"step": 0, "loss": "nan", "grad_norm": "inf", "kl": "-inf", "reward_mean": 0.5}
    row = read_metrics(tmp_path)[0]
    assert math.isnan(row["loss"]) and row["grad_norm"] == math.inf and row["kl"] == -math.inf


def test_torn_last_metrics_line_is_dropped_and_a_bad_middle_line_named(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "lo')  # killed mid-write
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]
    MetricsWriter(tmp_path).truncate_after(0)
    assert p.read_text() == '{"step": 0}\n'
    p.write_text('{"step": 0}\ngarbage\n{"step": 2}\n')
    with pytest.raises(RunOutputError, match=r"metrics.jsonl:2 is not a metrics record"):
        read_metrics(tmp_path)


def test_no_unsafe_torch_load_in_core():
    import rlcore

    root = os.path.dirname(rlcore.__file__)
    offenders = []
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                text = open(os.path.join(dirpath, f)).read()
                if "weights_only=False" in text or "pickle.load" in text:
                    offenders.append(os.path.join(dirpath, f))
    assert offenders == []
    assert issubclass(CheckpointError, RLCoreError) and pickle  # noqa: B018
