"""Reward functions that misbehave: one that never returns stops the run after
``data.reward_timeout_seconds``, one that raises or returns a number no float (or float32) holds is a
one-line RewardError naming the function, the sample and the step; NumPy scalars, 0-d arrays and
0-d tensors are rewards; with several data-parallel ranks only the writer calls the function.

The runs are one step of the tiny model (examples/tiny.yaml) through ``rlcore train``."""

from __future__ import annotations

import math
import sys
import threading
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from rlcore.cli import main
from rlcore.config import training_fingerprint
from rlcore.errors import NonFiniteError, RewardError
from rlcore.guards import REWARD_LIMIT, checked_reward
from rlcore.rewards import RewardCalls
from rlcore.run_output import read_metrics
from rlcore.stack import load_config

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "tiny.yaml")
SMALL = ["training.steps=1", "rollout.n=4", "data.prompts_per_step=4", "output.plot=false",
         "output.tensorboard=false", "output.progress=false"]

REWARDS = """
import threading
import numpy as np
import torch
from rlcore.tasks import successor_reward
RELEASE = threading.Event()  # set by the test's teardown: the abandoned call then returns
CALLS = [0]
def hangs_at_sample_2(x):
    CALLS[0] += 1
    if CALLS[0] == 3:
        RELEASE.wait(60)  # "forever" for the run; a run without a time limit would finish after 60 s
    return successor_reward(x)
def raises_at_sample_1(x):
    CALLS[0] += 1
    if CALLS[0] == 2:
        return x.meta["no such key"]
    return successor_reward(x)
def huge_int(x):
    return 10**400
def minus_1e308(x):
    return -1e308
def numpy_and_torch(x):  # a different type on every call
    CALLS[0] += 1
    r = successor_reward(x)
    kinds = [np.float32(r), np.int64(r), np.array(r), np.array([r], dtype=np.float16), torch.tensor(r),
             torch.tensor([r], dtype=torch.bfloat16), np.uint8(r), np.float64(r)]
    return kinds[CALLS[0] % len(kinds)]
"""


@pytest.fixture
def rewards_module(tmp_path, monkeypatch):
    (tmp_path / "misbehaving_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "misbehaving_rewards"
    mod = sys.modules.pop("misbehaving_rewards", None)
    if mod is not None:
        mod.RELEASE.set()


def _train(out, *extra):
    return main(["train", TINY, "--output", str(out), "--overwrite", *SMALL, *extra])


def _one_line_error(capsys):
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlcore: error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def test_a_reward_that_never_returns_stops_the_run_naming_function_sample_and_limit(tmp_path, rewards_module, capsys):
    t0 = time.monotonic()
    assert _train(tmp_path / "run", "data.reward_timeout_seconds=0.5",
                  f"data.reward={rewards_module}:hangs_at_sample_2") == 2
    took = time.monotonic() - t0
    err = _one_line_error(capsys)
    assert f"reward function {rewards_module}:hangs_at_sample_2 did not return within 0.5 s" in err, err
    assert "data.reward_timeout_seconds" in err and "sample 2 of step 0 (prompt 0: " in err, err
    assert "abandoned" in err, err
    assert took < 50, f"the run took {took:.0f} s: the limit did not stop the call"
    assert not read_metrics(tmp_path / "run"), "the step was not logged as trained"


def test_the_timeout_setting_is_checked_and_does_not_change_the_fingerprint(capsys):
    assert main(["check", TINY, "data.reward_timeout_seconds=-1"]) == 2
    err = capsys.readouterr().err
    assert "data.reward_timeout_seconds" in err and "must be >= 0" in err, err
    cfg, _ = load_config(TINY, ["data.reward_timeout_seconds=600"])
    assert cfg.data.reward_timeout_seconds == 600
    # resuming a run stopped by the limit with a larger one is the point: not a config change
    assert training_fingerprint(cfg) == training_fingerprint(load_config(TINY)[0])
    assert load_config(TINY)[0].data.reward_timeout_seconds == 60, "the default is generous"


def test_an_exception_in_the_reward_is_named_with_where_it_was_raised(tmp_path, rewards_module, capsys):
    assert _train(tmp_path / "run", f"data.reward={rewards_module}:raises_at_sample_1") == 2
    err = _one_line_error(capsys)
    assert f"reward function {rewards_module}:raises_at_sample_1 raised KeyError: 'no such key'" in err, err
    assert "misbehaving_rewards.py:" in err and "sample 1 of step 0 (prompt 0: " in err, err


@pytest.mark.parametrize("fn, shown", [("huge_int", "..."), ("minus_1e308", "returned -1e+308")])
def test_rewards_no_float32_holds_are_named(tmp_path, rewards_module, capsys, fn, shown):
    assert _train(tmp_path / "run", f"data.reward={rewards_module}:{fn}") == 2
    err = _one_line_error(capsys)
    assert f"reward function {rewards_module}:{fn} returned" in err and "for sample 0 of step 0" in err, err
    assert shown in err and "exceeds 3.402823e+38, the largest float32" in err, err
    assert len(err) < 600, "10**400 is not printed in full"


def test_numpy_scalars_and_0d_tensors_are_rewards(tmp_path, rewards_module):
    out = tmp_path / "run"
    assert _train(out, "training.steps=2", f"data.reward={rewards_module}:numpy_and_torch") == 0
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1]
    assert all(0.0 <= r["reward_mean"] <= 1.0 and math.isfinite(r["loss"]) for r in rows)


# ------------------------------------------------------------------ the checks, value by value ----

@pytest.mark.parametrize("value, expected", [
    (np.float32(0.5), 0.5), (np.float16(-2.0), -2.0), (np.int64(3), 3.0), (np.uint8(7), 7.0), (np.array(1.5), 1.5),
    (np.array([[2]], dtype=np.int32), 2.0), (torch.tensor(0.25), 0.25), (torch.tensor([4], dtype=torch.int64), 4.0),
    (Fraction(1, 4), 0.25), (1, 1.0), (-0.0, 0.0), (REWARD_LIMIT, REWARD_LIMIT), (-REWARD_LIMIT, -REWARD_LIMIT),
])
def test_real_numbers_are_accepted(value, expected):
    got = checked_reward(value, "reward function f returned it for sample 0 of step 0")
    assert type(got) is float and got == expected


@pytest.mark.parametrize("value, named", [
    ("1.0", "not str"), (None, "not NoneType"), ([1.0], "not list"), (True, "not bool (for a 0/1 reward"),
    (np.bool_(True), "not numpy.bool"), (np.array([1.0, 2.0]), "not numpy.ndarray"), (np.array("x"), "numpy.ndarray"),
    (torch.tensor(True), "not torch.Tensor"), (torch.tensor([1.0, 2.0]), "not torch.Tensor"), (1 + 2j, "not complex"),
])
def test_other_values_are_refused_naming_the_type(value, named):
    with pytest.raises(RewardError, match="a reward must be a real number") as e:
        checked_reward(value, "reward function f returned it for sample 0 of step 0")
    assert named in str(e.value)


@pytest.mark.parametrize("value", [10**400, -(10**400), 1e308, -1e308, Fraction(10**400), np.float64(1e39)])
def test_magnitudes_beyond_float32_are_refused(value):
    with pytest.raises(RewardError, match="exceeds 3.402823e[+]38, the largest float32"):
        checked_reward(value, "reward function f returned it for sample 0 of step 0")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, np.float32("nan"), torch.tensor(math.inf)])
def test_nonfinite_rewards_stay_nonfinite_errors(value):
    with pytest.raises(NonFiniteError, match="rewards must be finite") as e:
        checked_reward(value, "reward function f returned it for sample 0 of step 0")
    assert e.value.what == "reward"


def _where(i):
    return f"sample {i} of step 7"


def test_the_time_limit_is_per_call_not_per_step():
    calls = RewardCalls(lambda x: time.sleep(0.3) or x, "m:slow", timeout_seconds=0.5)
    t0 = time.monotonic()
    assert calls.score([1, 2, 3, 4], _where) == [1.0, 2.0, 3.0, 4.0], "1.2 s in all, 0.3 s each: within the limit"
    assert time.monotonic() - t0 >= 1.2


def test_a_timed_out_worker_is_replaced_and_the_stuck_call_abandoned():
    release = threading.Event()
    seen: list[int] = []

    def fn(x):
        seen.append(x)
        if x == 1:
            release.wait(30)
        return x

    calls = RewardCalls(fn, "m:stuck", timeout_seconds=0.3)
    try:
        with pytest.raises(RewardError, match=r"m:stuck did not return within 0.3 s .* on sample 1 of step 7"):
            calls.score([0, 1, 2], _where)
        assert calls.score([5], _where) == [5.0], "a new worker serves the next step"
    finally:
        release.set()
    time.sleep(0.2)
    assert 2 not in seen, "the abandoned step's remaining calls are not made"


def test_without_a_limit_the_reward_runs_on_the_callers_thread():
    threads = []
    RewardCalls(lambda x: threads.append(threading.current_thread()) or 1.0, "m:f", 0).score([0], _where)
    assert threads == [threading.main_thread()]


def test_a_reward_needing_the_main_thread_is_told_how():
    import signal

    def uses_alarm(x):  # math-verify style: a SIGALRM timeout inside the reward
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        return 1.0

    with pytest.raises(RewardError, match="needs both data.reward_timeout_seconds=0 and loop.mode=sync"):
        RewardCalls(uses_alarm, "m:alarm", 5).score([0], _where)
    assert RewardCalls(uses_alarm, "m:alarm", 0).score([0], _where) == [1.0]
    # the overlapped loop scores on the rollout producer's thread: told so with no time limit too
    failed = []
    worker = threading.Thread(target=lambda: failed.append(pytest.raises(RewardError, RewardCalls(
        uses_alarm, "m:alarm", 0).score, [0], _where)))
    worker.start()
    worker.join()
    assert "loop.mode is not sync" in str(failed[0].value)


# ------------------------------------------------------------------------- data parallel ----

DP_REWARDS = """
import os
from rlcore.tasks import successor_reward
CALLS = [0]
def logged(x):
    CALLS[0] += 1
    with open(os.path.join(os.environ["RLCORE_TEST_REWARD_LOG"], str(os.getpid())), "a") as f:
        f.write("x")
    if CALLS[0] > 16:  # step 1 (16 samples a step): raises on the writer
        raise RuntimeError("judge unavailable")
    return successor_reward(x)
"""


def _rank(rank: int, port: int, out: str, extra: list[str]) -> None:
    from rlcore.parallel.worker import config_yaml, run_rank
    from rlcore.stack import load_stack

    stack = load_stack(TINY, SMALL + extra + [f"output.dir={out}"])
    run_rank(config_yaml(stack.config), rank, 2, f"127.0.0.1:{port}")


@pytest.mark.slow
def test_data_parallel_ranks_score_on_the_writer_and_all_stop_on_its_error(tmp_path, monkeypatch, gloo_ranks):
    (tmp_path / "dp_rewards.py").write_text(DP_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    log = tmp_path / "calls"
    log.mkdir()
    monkeypatch.setenv("RLCORE_TEST_REWARD_LOG", str(log))
    ranks = gloo_ranks(_rank, str(tmp_path / "run"), ["training.steps=2", "data.reward=dp_rewards:logged"])
    assert None not in ranks.exitcodes, "a rank was left waiting"
    got = ranks.outcomes
    assert sorted(got) == [0, 1], got
    calls = {int(f.name): len(f.read_text()) for f in log.iterdir()}
    assert list(calls) == [got[0][0]], f"only the writer (pid {got[0][0]}) calls the reward: {calls}"
    assert calls[got[0][0]] == 17, "16 samples of step 0, then the failing first call of step 1"
    for rank in (0, 1):
        assert got[rank][1].startswith("RewardError: reward function dp_rewards:logged raised RuntimeError: "
                                       "judge unavailable"), got
        assert "sample 0 of step 1" in got[rank][1], got
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [0]


def test_nonfinite_error_crosses_a_process_boundary_with_its_fields():
    """Ranks and Ray actors pickle the error the writer raised; it kept only its message before."""
    import pickle

    from rlcore.errors import NonFiniteError

    back = pickle.loads(pickle.dumps(NonFiniteError("reward of sample 3 is nan", what="reward", skippable=True)))
    assert (str(back), back.what, back.skippable) == ("reward of sample 3 is nan", "reward", True)
