"""Fault injection: `rlcore train` is SIGKILLed at a named point (RLCORE_FAULT, see
rlcore.faults and docs/reliability.md) and `--resume` continues from the last good checkpoint.

On CPU with a fixed seed a step is a pure function of (weights, optimizer state, RNG states,
step number): prompts and sampling seeds derive from the step, and a checkpoint carries the
rest. So every metric of the killed-and-resumed run, timings aside, equals the uninterrupted
run's exactly: no tolerance. The uninterrupted and resumed runs go in-process (no second
interpreter start); the killed runs are subprocesses."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from rlcore.testing.runs import comparable_metrics, list_checkpoints, load_checkpoint, main, read_metrics

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "tiny.yaml")
STEPS = 6
ARGS = [f"training.steps={STEPS}", "output.checkpoint_every=2", "rollout.n=4", "data.prompts_per_step=4",
        "output.plot=false", "output.tensorboard=false", "output.progress=false"]

# (RLCORE_FAULT, metrics rows written before the kill, the newest committed checkpoint then);
# checkpoints are written after steps 1, 3 and 5
FAULTS = [
    ("rollout:5", 4, 3),            # step 4's samples just came back
    ("push:4", 3, 1),               # step 3's weights half-way into the rollout engine
    ("checkpoint_write:2", 4, 1),   # step 3's checkpoint written to its temporary file, not renamed
    ("checkpoint_meta:2", 4, 1),    # step 3's state file renamed, its commit record not yet written
]


def _numbers(rows):
    return comparable_metrics(rows)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    assert main(["train", TINY, "--output", str(out), *ARGS]) == 0
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(STEPS))
    return _numbers(rows)


@pytest.mark.slow
@pytest.mark.parametrize("fault,rows_before,last_good", FAULTS, ids=[f[0].split(":")[0] for f in FAULTS])
def test_sigkill_then_resume_equals_an_uninterrupted_run(tmp_path, uninterrupted, fault, rows_before, last_good):
    out = tmp_path / "run"
    env = dict(os.environ, RLCORE_FAULT=fault)
    proc = subprocess.run([sys.executable, "-m", "rlcore.cli", "train", TINY, "--output", str(out), *ARGS],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert [r["step"] for r in read_metrics(out)] == list(range(rows_before)), "killed at the point named"
    assert list_checkpoints(out)[-1][0] == last_good

    assert main(["train", TINY, "--output", str(out), "--resume", *ARGS]) == 0
    assert _numbers(read_metrics(out)) == uninterrupted
    left = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert not [n for n in left if n.startswith(".")], f"interrupted writes were cleaned up: {left}"


def test_a_kill_in_the_final_checkpoint_never_damages_the_newest_one(tmp_path):
    """The run ends after step 1, whose checkpoint (the second write) is committed. The final
    checkpoint used to write step 1 again in place: a kill between its state file and its record
    (the third write) left the newest checkpoint "corrupt". A committed file is never rewritten,
    so there is no third write to kill."""
    out = tmp_path / "run"
    env = dict(os.environ, RLCORE_FAULT="checkpoint_meta:3")
    args = [a for a in ARGS if not a.startswith(("training.steps", "output.checkpoint_every"))]
    proc = subprocess.run([sys.executable, "-m", "rlcore.cli", "train", TINY, "--output", str(out), *args,
                           "training.steps=2", "output.checkpoint_every=1"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    state, record, _ = load_checkpoint(out)
    assert state["step"] == record["step"] == 1
    assert [s for s, _ in list_checkpoints(out)] == [0, 1]
