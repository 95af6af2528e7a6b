"""The overlapped loop keeps its staleness bound (issue 38 item 6, docs/async.md): run
examples/tiny_async.yaml for a few steps and read the bound back from metrics.jsonl. A sample's
staleness is the trainer's weight version when it trains the sample (the weights the step's update
starts from) minus the version of the sample's oldest token; ``loop/staleness_max`` and
``loop/staleness_mean`` are those of the samples each step trains. Before the fix the example
(``max_staleness: 1, ahead_steps: 2, stale: rescore``) trained every sample two versions old from
step 2, and the same settings with ``stale: drop`` dropped step 2 whole and stopped the run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rlcore.errors import RolloutError
from rlcore.loop_settings import ahead_steps, loop_note
from rlcore.rollout_producer import apply_staleness
from rlcore.stack import load_config
from rlcore.testing.runs import main, read_metrics
from rlcore.types import Sample

ROOT = Path(__file__).resolve().parents[1]
TINY_ASYNC = str(ROOT / "examples" / "tiny_async.yaml")
STEPS = 6
ARGS = [f"training.steps={STEPS}", "rollout.n=4", "data.prompts_per_step=4", "output.plot=false",
        "output.tensorboard=false", "output.progress=false", "output.checkpoint_every=0"]
SAMPLES_PER_STEP = 16


def _train(tmp_path: Path, *overrides: str) -> list[dict]:
    out = tmp_path / "run"
    assert main(["train", TINY_ASYNC, "--output", str(out), *ARGS, *overrides]) == 0
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(STEPS)), "the run did not train every step"
    return rows


def _assert_bound(rows: list[dict], bound: int) -> None:
    for r in rows:
        assert r["loop/staleness_max"] <= bound, f"step {r['step']} trained a sample {r['loop/staleness_max']} " \
                                                 f"versions old (bound {bound})"
        assert 0 <= r["loop/staleness_mean"] <= r["loop/staleness_max"]
        assert r["loop/stale_samples"] == 0 and r["loop/dropped_samples"] == 0
        assert r["samples"] == SAMPLES_PER_STEP  # nothing left the step: nothing was generated past the bound
    assert rows[0]["loop/staleness_max"] == 0  # step 0 is generated on the weights it trains
    # the producer did run ahead (the tiny model trains slower than it generates): the bound is met,
    # not just respected because nothing overlapped
    assert max(r["loop/staleness_max"] for r in rows) == bound


@pytest.mark.parametrize("overrides,bound", [
    ((), 1),  # the example as shipped: async, max_staleness 1
    (("loop.mode=one_step_off",), 1),
    (("loop.max_staleness=2",), 2),
    # the example's former settings: the producer asked to run two steps ahead, what ends up older dropped
    (("loop.ahead_steps=2", "loop.stale=drop"), 1),
    (("loop.max_staleness=2", "loop.ahead_steps=3", "loop.stale=drop"), 2),
], ids=["example", "one_step_off", "async-2", "ahead2-drop", "async-2-ahead3-drop"])
def test_no_sample_trains_further_behind_than_max_staleness(tmp_path, overrides, bound):
    _assert_bound(_train(tmp_path, *overrides), bound)


def test_rescore_past_the_bound_is_counted_and_rescored(tmp_path):
    """ahead_steps > max_staleness with stale: rescore is the one setting that trains past the bound
    (its note says so): every sample older than the bound is counted and re-scored, none is older
    than ahead_steps."""
    rows = _train(tmp_path, "loop.ahead_steps=2", "loop.stale=rescore")
    assert all(r["loop/staleness_max"] <= 2 for r in rows)
    assert max(r["loop/staleness_max"] for r in rows) == 2  # the producer did run two steps ahead
    for r in rows:
        if r["loop/staleness_max"] > 1:
            assert r["loop/stale_samples"] > 0
        if r["loop/stale_samples"] == SAMPLES_PER_STEP:  # every behaviour log-prob is the trainer's
            assert r["mismatch/abs_logprob_diff_max"] == 0.0


def _loop(*overrides: str):
    return load_config(TINY_ASYNC, overrides)[0].loop


def test_the_producer_never_starts_a_step_drop_would_discard():
    drop = _loop("loop.ahead_steps=2", "loop.stale=drop")
    assert ahead_steps(drop) == 1
    assert "loop.ahead_steps=2 runs as 1 with loop.stale=drop" in loop_note(drop)
    rescore = _loop("loop.ahead_steps=2", "loop.stale=rescore")
    assert ahead_steps(rescore) == 2 and "train up to 2 versions behind" in loop_note(rescore)
    assert loop_note(_loop()) is None  # the example runs within its bound, no note


def _sample(prompt: int, version: int, spans=None) -> Sample:
    return Sample(prompt_ids=[1, 2], response_ids=torch.tensor([3, 4]), logprobs=torch.zeros(2),
                  prompt_index=prompt, weight_version=version, weight_versions=spans)


def test_drop_measures_the_samples_it_trains_and_names_the_settings_when_none_is_left():
    """A backend may still hand over samples older than the producer started on (a partial rollout's
    oldest span counts): drop removes their groups, the metrics describe what is trained."""
    loop = _loop()  # max_staleness 1, stale drop
    samples = [_sample(0, 4), _sample(0, 4), _sample(1, 4, ((2, 0), (4, 1))), _sample(1, 4), _sample(2, 3)]
    kept, rewards, rescore, m = apply_staleness(samples, [0.0, 1.0, 2.0, 3.0, 4.0], 4, loop, step=7)
    assert [s.prompt_index for s in kept] == [0, 0, 1] and rewards == [0.0, 1.0, 4.0]  # group 1 dropped
    assert m["loop/stale_samples"] == 1 and m["loop/dropped_samples"] == 2 and not rescore.any()
    assert m["loop/staleness_max"] == 1 and m["loop/staleness_mean"] == pytest.approx(1 / 3)
    with pytest.raises(RolloutError) as info:
        apply_staleness([_sample(0, 1)], [0.0], 4, loop, step=7, start_version=3)
    msg = str(info.value)
    assert "step 7" in msg and "loop.max_staleness=1" in msg and "started it on version 3" in msg
    assert "loop.stale=rescore" in msg
