"""The overlapped loop never hangs in silence (docs/async.md, docs/reliability.md): a rollout that
stops answering mid-generation ends the run within its loop.timeouts key with an error naming
who did not answer and what it was doing; a trainer SIGKILLed mid-push (with or without requests
in flight) resumes from its last checkpoint, regenerating what was in flight. Faults come from
rlcore.faults (RLCORE_FAULT: ``hang`` makes the producer thread stop answering inside a generate
call, a kill is a real SIGKILL); every run is bounded by a subprocess timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rlcore.testing.runs import comparable_metrics, list_checkpoints, main, read_metrics

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "tiny.yaml")
STEPS = 5
ARGS = [f"training.steps={STEPS}", "output.checkpoint_every=1", "rollout.n=4", "data.prompts_per_step=4",
        "output.plot=false", "output.tensorboard=false", "output.progress=false"]
LIMIT_S = 240  # no run here may take longer: a hang fails the test instead of the CI job


def _run(out: Path, fault: str, *overrides: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, RLCORE_FAULT=fault)
    return subprocess.run([sys.executable, "-m", "rlcore.cli", "train", TINY, "--output", str(out), *ARGS,
                           *overrides], env=env, capture_output=True, text=True, timeout=LIMIT_S)


def _numbers(rows):
    return comparable_metrics(rows, drop_prefixes=("loop/",))


def test_a_rollout_that_stops_answering_mid_generation_ends_the_run_naming_it(tmp_path):
    # step 1's generate call never returns: the trainer trains step 0, pushes, then waits for step 1
    proc = _run(tmp_path / "run", "producer:2:hang", "loop.mode=one_step_off", "loop.timeouts.samples_s=4",
                "loop.timeouts.join_s=1")
    assert proc.returncode not in (0, -signal.SIGKILL), proc.stderr[-2000:]
    err = " ".join((proc.stderr + proc.stdout).split())
    assert "the trainer waited for step 1's samples" in err, err[-2000:]
    assert "the rollout producer (generating step 1, 1 generate call(s) in flight)" in err
    assert "loop.timeouts.samples_s=4 s" in err
    # and the producer that ignores the stop is reported, not waited for
    assert "the rollout producer did not stop within loop.timeouts.join_s=1 s" in err
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [0]


def test_a_push_that_waits_for_requests_that_never_finish_names_them(tmp_path):
    proc = _run(tmp_path / "run", "producer:2:hang", "loop.mode=one_step_off", "loop.in_flight=keep",
                "loop.timeouts.push_s=3", "loop.timeouts.join_s=1")
    assert proc.returncode not in (0, -signal.SIGKILL), proc.stderr[-2000:]
    err = " ".join(proc.stderr.split())
    assert ("the push of weight version 1 waited for the rollout's 1 generate call(s) in flight (step 1, "
            "loop.in_flight=keep) to finish, and they did not within loop.timeouts.push_s=3 s") in err, err[-2000:]


@pytest.mark.slow  # two runs, one killed; the hang tests above cover the loop's waits fast
def test_a_trainer_killed_mid_push_with_requests_in_flight_resumes(tmp_path):
    # step 3's generate call is held in flight; the push that meets it (abort: it goes ahead) is killed
    out = tmp_path / "run"
    proc = _run(out, "producer:4:hang,push_in_flight:1", "loop.mode=one_step_off")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    killed_after = len(read_metrics(out))
    assert 1 <= killed_after < STEPS and list_checkpoints(out)
    assert main(["train", TINY, "--output", str(out), "--resume", *ARGS, "loop.mode=one_step_off"]) == 0
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(STEPS))
    # the samples generated ahead of the checkpoint were not saved: the first resumed step's are regenerated
    # from the checkpoint's weights (staleness 0), the next ones run one step off again
    first = list_checkpoints(out)[0][0] + 1
    resumed = [r for r in rows if r["step"] >= killed_after - 1]
    assert resumed and all(r["loop/staleness_max"] <= 1 for r in resumed) and first >= 1


@pytest.mark.slow
def test_a_trainer_killed_mid_push_resumes_to_the_sync_runs_numbers(tmp_path):
    """async with max_staleness 0 is the sync loop: killed mid-push (step 2's weights half-way into
    the rollout) and resumed, every number equals an uninterrupted synchronous run's."""
    sync = tmp_path / "sync"
    assert main(["train", TINY, "--output", str(sync), *ARGS]) == 0
    out = tmp_path / "run"
    proc = _run(out, "push:3", "loop.mode=async", "loop.max_staleness=0")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert [r["step"] for r in read_metrics(out)] == [0, 1]
    assert main(["train", TINY, "--output", str(out), "--resume", *ARGS, "loop.mode=async",
                 "loop.max_staleness=0"]) == 0
    assert _numbers(read_metrics(out)) == _numbers(read_metrics(sync))


def test_sigterm_stops_an_async_run_at_the_step_boundary_with_the_producer_joined(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "rlcore.cli", "train", TINY, "--output", str(out), *ARGS, "training.steps=500",
           "loop.mode=async", "loop.max_staleness=2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + LIMIT_S
        while not (out / "metrics.jsonl").exists() or len(read_metrics(out)) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)  # the producer is running ahead, requests may be in flight
        _, err = proc.communicate(timeout=LIMIT_S)
    finally:
        proc.kill()
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in err and "--resume" in err, err[-3000:]
    steps = [r["step"] for r in read_metrics(out)]
    assert steps == list(range(len(steps))) and len(steps) < 500
    assert list_checkpoints(out)[-1][0] == steps[-1], "the last finished step is checkpointed"
