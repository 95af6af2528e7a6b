"""Reliability of `rlcore train` on CPU: non-finite values never reach the optimizer, the rollout
engine or a checkpoint; one run per output directory; bad checkpoints are one-line errors.

Each run is a few steps of the tiny model (about 2-4 s each on the CI machine)."""

import json
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rlcore.testing.runs import list_checkpoints, main, read_metrics

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "tiny.yaml")
SMALL = ["rollout.n=4", "data.prompts_per_step=4", "output.plot=false", "output.tensorboard=false",
         "output.progress=false"]
PER_STEP = 16  # rewards per step with SMALL

# a reward function that misbehaves on chosen calls (module state counts the calls of this process)
REWARDS = f"""
import math
from rlcore.tasks import successor_reward
CALLS = [0]
def nan_at_step_2_sample_3(x):
    CALLS[0] += 1
    return math.nan if CALLS[0] == 2 * {PER_STEP} + 4 else successor_reward(x)
def huge_at_step_1(x):  # finite rewards whose group mean overflows: non-finite advantages
    CALLS[0] += 1
    if {PER_STEP} < CALLS[0] <= 2 * {PER_STEP}:
        return -3e38 if CALLS[0] % 4 == 0 else 3e38
    return successor_reward(x)
def text(x):
    return "1.0"
"""

# plugins that break the train pass at step 1: a NaN loss term, a finite term with a NaN gradient
# (d sqrt(u)/du at u = 0 is inf, times du/dθ = 0), NaN written into the LM-head weight after the update
BREAKER = """
import math
import torch
from rlcore import PLUGIN_API, hookimpl
from rlcore.types import PostprocessResult
MODE = {mode!r}
@hookimpl
def postprocess(ctx, output):
    if ctx.phase != "train" or ctx.step != 1:
        return None
    lp = output.head.logprobs
    if MODE == "loss":
        return PostprocessResult(loss_terms={{"broken": lp.sum() * 0.0 + math.nan}})
    if MODE == "grad":
        return PostprocessResult(loss_terms={{"broken": torch.sqrt(lp.sum() * 0.0)}})
    HEAD.append(output.head_weight.weight)
    return None
HEAD = []
@hookimpl
def step_end(ctx):  # after the optimizer step, before the push: as if the update had made it NaN
    if MODE == "weights" and HEAD:
        with torch.no_grad():
            HEAD[-1][0, 0] = math.nan
    return None
"""


@pytest.fixture
def rewards_module(tmp_path, monkeypatch):
    (tmp_path / "flaky_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "flaky_rewards"
    import sys

    sys.modules.pop("flaky_rewards", None)


def _breaker(fake_distribution, mode):
    fake_distribution("rlcore-breaker", "0.0.1", {"breaker": "breaker_mod"}, {"breaker_mod": BREAKER.format(mode=mode)})
    return "plugins=[breaker]"


def _train(out, *extra):
    return main(["train", TINY, "--output", str(out), *SMALL, *extra])


def _one_line_error(capsys):
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlcore: error: ") and "\n" not in err and "Traceback" not in err, err
    return err


# --------------------------------------------------------------------------- non-finite ----

def test_nan_reward_stops_naming_the_sample_and_the_reward_function(tmp_path, rewards_module, capsys):
    out = tmp_path / "run"
    rc = _train(out, "training.steps=4", "output.checkpoint_every=1",
                f"data.reward={rewards_module}:nan_at_step_2_sample_3")
    assert rc == 2
    err = _one_line_error(capsys)
    assert f"reward function {rewards_module}:nan_at_step_2_sample_3 returned nan for sample 3 of step 2" in err
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[-1]["nonfinite"] == "reward" and "stopped" in rows[-1]
    assert [s for s, _ in list_checkpoints(out)] == [0, 1], "the last good checkpoint is step 1's"


def test_reward_that_is_not_a_number_is_named(tmp_path, rewards_module, capsys):
    assert _train(tmp_path / "run", "training.steps=1", f"data.reward={rewards_module}:text") == 2
    assert "returned '1.0' for sample 0 of step 0" in _one_line_error(capsys)


def test_nonfinite_advantages_skip_the_step_when_asked(tmp_path, rewards_module):
    out = tmp_path / "run"
    assert _train(out, "training.steps=3", "training.on_nonfinite=skip", "algorithm.normalize_std=false",
                  f"data.reward={rewards_module}:huge_at_step_1") == 0
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[1]["nonfinite"] == "advantages" and "skipped" in rows[1]
    assert [r["weight_version"] for r in rows] == [1, 1, 2], "a skipped step is neither trained nor pushed"
    assert rows[2]["sync_verified"] and math.isfinite(rows[2]["loss"])


def test_nan_loss_stops_and_leaves_the_last_good_checkpoint(tmp_path, fake_distribution, capsys):
    out = tmp_path / "run"
    breaker = _breaker(fake_distribution, "loss")
    rc = _train(out, breaker, "training.steps=3", "output.checkpoint_every=1")
    assert rc == 2
    err = _one_line_error(capsys)
    assert "step 1: non-finite loss: nan in train micro-batch 0" in err and "training.on_nonfinite=skip" in err
    ckpts = list_checkpoints(out)
    assert [s for s, _ in ckpts] == [0]
    record = json.loads(ckpts[0][1].read_text())
    assert record["step"] == 0
    rows = read_metrics(out)
    assert rows[-1]["step"] == 1 and rows[-1]["nonfinite"] == "loss"

    # the way on: resume from that checkpoint, dropping such steps
    assert _train(out, breaker, "training.steps=3", "output.checkpoint_every=1", "training.on_nonfinite=skip",
                  "--resume") == 0
    rows = read_metrics(out)
    assert [(r["step"], r["weight_version"], r.get("nonfinite")) for r in rows] == [(0, 1, None), (1, 1, "loss"),
                                                                                   (2, 2, None)]


def test_nan_gradient_with_finite_loss_is_skipped_and_weights_stay_finite(tmp_path, fake_distribution):
    out = tmp_path / "run"
    assert _train(out, _breaker(fake_distribution, "grad"), "training.steps=3", "training.on_nonfinite=skip") == 0
    rows = read_metrics(out)
    assert rows[1]["nonfinite"] == "grad_norm" and "skipped" in rows[1]
    assert [r["weight_version"] for r in rows] == [1, 1, 2]
    assert all(math.isfinite(r["grad_norm"]) for r in (rows[0], rows[2]))
    assert all(math.isfinite(r["loss"]) for r in (rows[0], rows[2])), "the skipped step left no NaN behind"


def test_nonfinite_weights_are_never_pushed_or_checkpointed(tmp_path, fake_distribution, capsys):
    out = tmp_path / "run"
    rc = _train(out, _breaker(fake_distribution, "weights"), "training.steps=3", "output.checkpoint_every=1",
                "training.on_nonfinite=skip")
    assert rc == 2, "corrupted weights cannot be skipped: the run stops"
    err = _one_line_error(capsys)
    assert "weight tensor(s) are non-finite" in err and "lm_head.weight" in err and "before the push" in err
    rows = read_metrics(out)
    assert [r.get("weight_version") for r in rows] == [1, 1], "version 2 (NaN weights) was never pushed"
    assert [s for s, _ in list_checkpoints(out)] == [0]


# ------------------------------------------------------------------------ output directory ----

def test_one_run_per_output_directory(tmp_path, capsys):
    out = tmp_path / "run"
    assert _train(out, "training.steps=2", "output.checkpoint_every=1") == 0
    before = (out / "metrics.jsonl").read_text()
    capsys.readouterr()

    assert _train(out, "training.steps=2") == 2, "a second run into the same directory is refused"
    assert "is not empty" in _one_line_error(capsys)
    assert (out / "metrics.jsonl").read_text() == before

    assert _train(out, "training.steps=2", "training.lr=0.01", "--resume") == 2
    err = _one_line_error(capsys)
    assert "different config: training.lr: 0.001 -> 0.01" in err and "step-00000001.pt" in err

    assert _train(out, "training.steps=3", "--resume") == 0
    assert [r["step"] for r in read_metrics(out)] == [0, 1, 2]

    assert _train(out, "training.steps=1", "--overwrite") == 0
    assert [r["step"] for r in read_metrics(out)] == [0], "--overwrite started over"
    assert [s for s, _ in list_checkpoints(out)] == [0]


def _tree(d):
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


def test_overwrite_never_deletes_a_directory_rlcore_did_not_mark(tmp_path, capsys):
    """A home directory with checkpoints/, a checkpoint file and metrics.jsonl was wiped (rc 0)."""
    home = tmp_path / "home"
    (home / "checkpoints").mkdir(parents=True)
    (home / "checkpoint").write_text("my notes")
    (home / "metrics.jsonl").write_text('{"step": 0}\n')
    (home / ".bashrc").write_text("export PATH")
    before = _tree(home)
    assert _train(home, "training.steps=1", "--overwrite") == 2
    err = _one_line_error(capsys)
    assert "not an rlcore run directory" in err and "refusing to delete it" in err and f"rm -r {home}" in err
    assert _tree(home) == before


# a forward_fn provider whose factory fails: raised while the Trainer is built, after the output
# directory was taken (what rlcore check's preflight cannot foresee)
BROKEN_HEAD = """
from rlcore import hookimpl
from rlcore.types import ForwardFnSpec
PLUGIN_API = 1
def _build(ctx):
    raise RuntimeError("the broken head cannot be built here")
@hookimpl
def forward_fn():
    yield ForwardFnSpec(name="brokenhead", factory=_build)
"""


def test_a_failed_start_leaves_nothing_that_makes_the_retry_refuse(tmp_path, fake_distribution):
    fake_distribution("rlcore-brokenhead", "0.0.1", {"brokenhead": "brokenhead_mod"}, {"brokenhead_mod": BROKEN_HEAD})
    broken = ["plugins=[brokenhead]", "forward.name=brokenhead"]
    out = tmp_path / "runs" / "a"
    assert _train(out, "training.steps=1", *broken) == 2, "the factory\'s failure is a one-line error (rc 2)"
    assert not (tmp_path / "runs").exists(), "the new run's start failed: every directory it created is gone"

    out.mkdir(parents=True)
    assert _train(out, "training.steps=1", *broken) == 2, "the factory\'s failure is a one-line error (rc 2)"
    assert out.is_dir() and _tree(out) == [], "a directory that was there stays, emptied of what the start wrote"

    assert _train(out, "training.steps=1") == 0, "the retry, without --overwrite, runs"
    before = _tree(out)
    assert _train(out, "training.steps=2", *broken, "--resume", "--allow-config-change") == 2, "the factory\'s failure is a one-line error (rc 2)"
    assert _tree(out) == before, "a --resume start that fails deletes nothing"
    assert _train(out, "training.steps=2", "--resume") == 0, "and the run directory was released"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory; the file-size-limit "
                                               "test below covers a write that fails")
def test_a_read_only_output_directory_is_a_one_line_error(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    out.chmod(0o555)
    try:
        assert _train(out, "training.steps=1") == 2
    finally:
        out.chmod(0o755)
    assert "Permission denied" in _one_line_error(capsys)


def _limit_file_size(nbytes):
    def preexec():  # a full disk, as a write sees it: EFBIG part-way (SIGXFSZ ignored, as it is inherited)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
    return preexec


def _cli(out, *extra):
    return [sys.executable, "-m", "rlcore.cli", "train", TINY, "--output", str(out), *SMALL, *extra]


def test_a_checkpoint_that_does_not_fit_is_a_one_line_error_and_older_ones_stay(tmp_path):
    out = tmp_path / "run"
    assert _train(out, "training.steps=2", "output.checkpoint_every=2") == 0
    (_, rec), = list_checkpoints(out)
    ckpt = rec.with_suffix(".pt").stat().st_size
    largest_other = max(p.stat().st_size for p in out.rglob("*") if p.is_file() and "checkpoints" not in p.parts)
    limit = (ckpt + largest_other) // 2
    assert largest_other < limit < ckpt, (largest_other, ckpt)
    proc = subprocess.run(_cli(out, "training.steps=4", "output.checkpoint_every=2", "--resume"), capture_output=True,
                          text=True, timeout=300, preexec_fn=_limit_file_size(limit))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    err = proc.stderr.strip().splitlines()[-1]  # (after any library warning)
    assert err.startswith("rlcore: error: cannot write checkpoint"), err
    assert "step-00000003.pt" in err and "File too large" in err and "older checkpoints are intact" in err, err
    assert [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith(".")] == [], "no temporary left"
    assert [s for s, _ in list_checkpoints(out)] == [1]
    assert _train(out, "training.steps=4", "--resume") == 0, "the older checkpoint resumes"


# a reward function that waits at step 2 until the test says go: the test signals the run while a
# step is in progress (deterministically, whatever the machine's speed)
BARRIER = f"""
import os, time
from rlcore.tasks import successor_reward
CALLS = [0]
def wait_in_step_2(x):
    CALLS[0] += 1
    if CALLS[0] == 2 * {PER_STEP} + 1:
        d = os.environ["RLCORE_TEST_BARRIER"]
        open(os.path.join(d, "waiting"), "w").close()
        while not os.path.exists(os.path.join(d, "go")):
            time.sleep(0.01)
    return successor_reward(x)
"""


WAIT = "data.reward=barrier_rewards:wait_in_step_2"


@pytest.fixture
def barrier(tmp_path, monkeypatch):
    """The module above, importable here too: a --resume in this process has the same config."""
    (tmp_path / "barrier_rewards.py").write_text(BARRIER)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("barrier_rewards", None)


def _start_waiting_run(tmp_path, out, *extra):
    env = dict(os.environ, RLCORE_TEST_BARRIER=str(tmp_path),
               PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(_cli(out, "training.steps=6", "output.checkpoint_every=2", WAIT, *extra),
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not (tmp_path / "waiting").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    return proc


def _read_until(stream, text):
    lines = []
    for line in stream:
        lines.append(line)
        if text in line:
            return "".join(lines)
    raise AssertionError(f"{text!r} never came: {''.join(lines)[-3000:]}")


def test_second_process_is_refused_and_sigint_stops_at_the_step_boundary(tmp_path, barrier, capsys):
    out = tmp_path / "run"
    proc = _start_waiting_run(tmp_path, out)
    try:
        rows = (out / "metrics.jsonl").read_text()
        assert _train(out, "training.steps=6", WAIT, "--resume") == 2
        err = _one_line_error(capsys)
        assert f"in use by another rlcore process (pid {proc.pid}" in err, err
        assert _train(out, "training.steps=6", WAIT, "--overwrite") == 2
        assert f"pid {proc.pid}" in _one_line_error(capsys)
        assert (out / "metrics.jsonl").read_text() == rows, "the refused processes wrote nothing"

        proc.send_signal(signal.SIGINT)
        said = _read_until(proc.stderr, "stopping")
        assert "after step 2" in said and "again to stop at once" in said, said
        (tmp_path / "go").touch()
        _, rest = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, rest[-3000:]
    assert "stopped by SIGINT after step 2" in rest and f"--output {out}" in rest and "--resume" in rest, rest
    assert "Traceback" not in rest, rest
    assert [r["step"] for r in read_metrics(out)] == [0, 1, 2]
    assert [s for s, _ in list_checkpoints(out)] == [1, 2], "the last finished step is checkpointed"
    assert _train(out, "training.steps=4", WAIT, "--resume") == 0
    assert [r["step"] for r in read_metrics(out)] == [0, 1, 2, 3]


def test_a_second_sigterm_stops_at_once_with_the_last_checkpoint_intact(tmp_path, barrier):
    out = tmp_path / "run"
    proc = _start_waiting_run(tmp_path, out)
    try:
        proc.send_signal(signal.SIGTERM)
        _read_until(proc.stderr, "stopping")
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, rest[-3000:]
    assert "stopped at once by SIGTERM" in rest and "--resume" in rest and "Traceback" not in rest, rest
    assert [r["step"] for r in read_metrics(out)] == [0, 1], "step 2 never finished"
    assert [s for s, _ in list_checkpoints(out)] == [1]
    assert [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith(".")] == []
    assert _train(out, "training.steps=3", WAIT, "--resume") == 0


def test_resume_without_checkpoint_is_an_error(tmp_path, capsys):
    out = tmp_path / "run"
    assert _train(out, "training.steps=1", "output.checkpoint_every=0") == 0  # a final checkpoint only
    for p in (out / "checkpoints").iterdir():  # the state, its record and its HF export (a directory)
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    capsys.readouterr()
    assert _train(out, "training.steps=2", "--resume") == 2
    assert "no complete checkpoint" in _one_line_error(capsys)
    assert [r["step"] for r in read_metrics(out)] == [0], "no fresh run on top of the old metrics"


def test_legacy_pickle_checkpoint_is_never_unpickled(tmp_path, capsys):
    """rlcore before this change loaded checkpoint/state.pt with weights_only=False."""
    import torch

    class RunsCode:
        def __reduce__(self):
            return (open, (str(tmp_path / "pwned"), "w"))

    out = tmp_path / "run"
    (out / "checkpoint").mkdir(parents=True)
    torch.save({"engine": RunsCode(), "step": 0}, out / "checkpoint" / "state.pt")
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    assert _train(out, "training.steps=2", "--resume") == 2
    assert "older rlcore" in _one_line_error(capsys)
    assert not (tmp_path / "pwned").exists()


def test_corrupt_and_mismatched_checkpoints_are_one_line_errors(tmp_path, capsys):
    out = tmp_path / "run"
    assert _train(out, "training.steps=1") == 0
    (_, rec), = list_checkpoints(out)
    state = rec.with_suffix(".pt")
    good = state.read_bytes()
    state.write_bytes(good[:-10])
    capsys.readouterr()
    assert _train(out, "training.steps=2", "--resume") == 2
    assert f"checkpoint file {state} is truncated or altered" in _one_line_error(capsys)

    state.write_bytes(good)  # intact, but of a bigger model: the engine refuses its tensors
    record = json.loads(rec.read_text())
    record["config"]["engine.model.tiny.hidden_size"] = 256
    rec.write_text(json.dumps(record))
    assert _train(out, "training.steps=2", "--resume", "engine.model.tiny.hidden_size=256",
                  "--allow-config-change") == 2
    err = _one_line_error(capsys)
    assert f"checkpoint {state} does not fit this run: RuntimeError" in err and "size mismatch" in err


def test_a_model_with_nonfinite_weights_never_reaches_the_rollout_engine(tmp_path):
    import torch
    from rlcore.errors import NonFiniteError
    from rlcore.stack import load_stack
    from rlcore.testing.runs import Trainer

    trainer = Trainer(load_stack(TINY, [f"output.dir={tmp_path / 'run'}", "training.steps=1", *SMALL]))
    with torch.no_grad():
        trainer.engine.model.model.embed_tokens.weight[0, 0] = math.inf
    with pytest.raises(NonFiniteError, match=r"\['model.embed_tokens.weight'\]\) before the rollout engine starts"):
        trainer.run()
    assert not (tmp_path / "run" / "policy_hf").exists(), "nothing was handed to the rollout engine"
    assert not (tmp_path / "run").exists(), "a new run whose start failed removed what it created"
