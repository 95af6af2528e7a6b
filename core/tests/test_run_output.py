"""Run output: one run per directory, atomic kept checkpoints loaded safely, NaN-visible metrics."""

import json
import math
import os
import pickle

import pytest
import torch

from rlcore.config import fingerprint_diff
from rlcore.errors import CheckpointError, RLCoreError, RunOutputError
from rlcore.run_output import (
    CHECKPOINT_DIR,
    MetricsWriter,
    _sha256,
    list_checkpoints,
    load_checkpoint,
    prepare_output_dir,
    read_metrics,
    save_checkpoint,
)

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


def test_overwrite_clears_an_rlcore_run_but_never_another_directory(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    prepare_output_dir(run, resume=False, overwrite=True)
    assert run.is_dir() and not any(run.iterdir())

    other = tmp_path / "home"
    other.mkdir()
    (other / "thesis.tex").write_text("precious")
    with pytest.raises(RunOutputError, match="does not look like an rlcore run directory.*refusing"):
        prepare_output_dir(other, resume=False, overwrite=True)
    assert (other / "thesis.tex").read_text() == "precious"


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
    assert record["state_sha256"] == _sha256(tmp_path / CHECKPOINT_DIR / "step-00000004.pt")


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
    record.update(state_bytes=path.stat().st_size, state_sha256=_sha256(path))
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


# -------------------------------------------------------------------------------- metrics ----

def test_metrics_keep_nan_visible_and_read_back(tmp_path):
    w = MetricsWriter(tmp_path, tensorboard=False)
    w.write({"step": 0, "loss": math.nan, "grad_norm": math.inf, "kl": -math.inf, "reward_mean": 0.5})
    line = (tmp_path / "metrics.jsonl").read_text()
    assert json.loads(line) == {"step": 0, "loss": "nan", "grad_norm": "inf", "kl": "-inf", "reward_mean": 0.5}
    row = read_metrics(tmp_path)[0]
    assert math.isnan(row["loss"]) and row["grad_norm"] == math.inf and row["kl"] == -math.inf


def test_torn_last_metrics_line_is_dropped_and_a_bad_middle_line_named(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "lo')  # killed mid-write
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]
    MetricsWriter(tmp_path, tensorboard=False).truncate_after(0)
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
