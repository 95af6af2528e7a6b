"""The overlapped loop (loop.mode one_step_off / async, rlcore.rollout_producer, docs/async.md) on
the embedded default: async with max_staleness 0 is the synchronous loop run on another thread
(same process, same computations: its numbers are the sync run's exactly); one_step_off trains
on samples one version old, and the mismatch correction sees their behaviour log-probs (those of
the version that produced them, not the trainer's); stale samples are re-scored or dropped as
configured (drop: none is generated; tests/test_async_bound.py holds the bound); the
settings are refused by key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rlcore.errors import ConfigError
from rlcore.stack import load_config
from rlcore.testing.runs import comparable_metrics, main, read_metrics

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "tiny.yaml")
STEPS = 4
ARGS = [f"training.steps={STEPS}", "rollout.n=4", "data.prompts_per_step=4", "output.plot=false",
        "output.tensorboard=false", "output.progress=false", "output.checkpoint_every=0"]


def _train(tmp_path: Path, name: str, *overrides: str) -> list[dict]:
    out = tmp_path / name
    assert main(["train", TINY, "--output", str(out), *ARGS, *overrides]) == 0
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(STEPS))
    return rows


def _numbers(rows: list[dict]) -> list[dict]:
    return comparable_metrics(rows, drop_prefixes=("loop/",))


@pytest.fixture(scope="module")
def sync_rows(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("sync"), "run")


def test_async_with_max_staleness_0_reproduces_the_sync_run_exactly(tmp_path, sync_rows):
    rows = _train(tmp_path, "async0", "loop.mode=async", "loop.max_staleness=0")
    # one process, the same prompts, seeds, weights and kernels in the same order: bit for bit
    assert _numbers(rows) == _numbers(sync_rows)
    assert all(r["loop/staleness_max"] == 0 and r["loop/dropped_samples"] == 0 for r in rows)
    assert all(r["loop/trainer_wait_s"] >= 0 and "loop/producer_wait_s" in r for r in rows)


def test_one_step_off_trains_on_samples_one_version_old_with_their_behaviour_logprobs(tmp_path, sync_rows):
    rows = _train(tmp_path, "off", "loop.mode=one_step_off", "algorithm.mismatch.tis_cap=2.0")
    assert [r["loop/staleness_max"] for r in rows] == [0, 1, 1, 1]  # step 0's samples: version 0, as sync
    assert rows[0]["reward_mean"] == sync_rows[0]["reward_mean"]  # the same prompts and seeds
    # the correction's ratio p/q compares the trainer's log-probs with those of the version that
    # sampled: equal weights in sync (numerics only), one optimizer step apart here
    for r, s in zip(rows[1:], sync_rows[1:], strict=True):
        assert s["mismatch/abs_logprob_diff_max"] < 1e-4
        assert r["mismatch/abs_logprob_diff_max"] > 1e-3
        assert r["mismatch/kl_k3"] > 100 * max(s["mismatch/kl_k3"], 1e-12)


def test_stale_samples_are_rescored_with_the_trainers_logprobs(tmp_path):
    rows = _train(tmp_path, "rescore", "loop.mode=async", "loop.max_staleness=0", "loop.ahead_steps=1",
                  "loop.stale=rescore")
    for r in rows[1:]:
        assert r["loop/staleness_max"] == 1 and r["loop/stale_samples"] == 16
        # behaviour log-probs replaced by the recomputed ones: the correction sees no mismatch
        assert r["mismatch/abs_logprob_diff_max"] == 0.0
        assert r["logprob_mismatch_max"] > 1e-3  # measured before the re-score: they were stale


def test_drop_never_generates_past_the_bound_so_ahead_steps_above_it_runs_as_the_sync_loop(tmp_path, sync_rows):
    """With stale=drop a step started further ahead than max_staleness would be dropped whole (it
    once stopped the run at step 1): the producer starts none, so max_staleness 0 is the sync run."""
    rows = _train(tmp_path, "drop", "loop.mode=async", "loop.max_staleness=0", "loop.ahead_steps=1",
                  "loop.stale=drop")
    assert _numbers(rows) == _numbers(sync_rows)
    assert all(r["loop/staleness_max"] == 0 and r["loop/dropped_samples"] == 0 for r in rows)


@pytest.mark.parametrize("override,key", [
    ("loop.mode=overlap", "loop.mode"),
    ("loop.stale=keep", "loop.stale"),
    ("loop.in_flight=wait", "loop.in_flight"),
    ("loop.max_staleness=-1", "loop.max_staleness"),
    ("loop.timeouts.push_s=0", "loop.timeouts.push_s"),
    ("loop.ahead_steps=2", "loop.ahead_steps"),  # sync does not run ahead
])
def test_bad_loop_settings_are_refused_naming_the_key(override, key):
    with pytest.raises(ConfigError) as info:
        load_config(TINY, [override])
    assert info.value.key == key and key in str(info.value)


def test_the_async_example_resolves(capsys):
    assert main(["check", str(ROOT / "examples" / "tiny_async.yaml"), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["engine"]["name"] == "hf"
