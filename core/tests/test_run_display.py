"""What a run shows its user besides metrics.jsonl: the reward plot's axis holds every reward
(negative ones too), and the step line shows the critic's and a multi-turn environment's
metrics when the run has them."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rlcore.cli import main
from rlcore.run_output import plot_rewards

ROOT = Path(__file__).resolve().parents[2]
STEP_LINE = re.compile(r"^step\s+\d+/\d+\s+reward", re.M)


def _write_metrics(out: Path, rewards: list[float]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows = [{"step": i, "reward_mean": r, "entropy": 1.0, "kl": 0.0} for i, r in enumerate(rewards)]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("rewards", [[-3.0, -2.5, -1.0, -0.2, 0.4], [-12.0, -11.0, -9.5], [0.5, 3.0, 7.0]])
def test_the_saved_plot_shows_every_reward(tmp_path, monkeypatch, rewards):
    """The reward axis of the PNG a run writes (read as it is saved) holds the rewards."""
    from matplotlib.figure import Figure

    limits = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **kw: (limits.append(fig.axes[0].get_ylim()),
                                                                    save(fig, *a, **kw))[1])
    _write_metrics(tmp_path, rewards)
    assert plot_rewards(tmp_path).is_file()
    (lo, hi), = limits
    assert lo < min(rewards) and max(rewards) < hi, f"the reward axis {lo, hi} cuts off rewards {rewards}"


def test_rewards_in_zero_one_keep_the_fixed_frame():
    """0/1 rewards (the tiny task's) are drawn on [0, 1], padded: two runs compare at a glance."""
    from rlcore.run_output import reward_axis_limits

    lo, hi = reward_axis_limits([0.0, 0.25, 1.0])
    assert (lo, hi) == reward_axis_limits([0.5]) and -0.05 < lo < 0.0 and 1.0 < hi < 1.05


finite_rewards = st.floats(min_value=-1e9, max_value=1e9, allow_nan=False, allow_infinity=False)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.one_of(finite_rewards, st.just(math.nan), st.just(-math.inf)), min_size=1, max_size=30))
def test_the_reward_axis_holds_every_finite_reward(rewards):
    from rlcore.run_output import reward_axis_limits

    lo, hi = reward_axis_limits(rewards)
    finite = [r for r in rewards if math.isfinite(r)]
    assert math.isfinite(lo) and math.isfinite(hi) and lo < hi
    if finite:
        assert lo < min(finite) and max(finite) < hi, (lo, hi, min(finite), max(finite))


def test_step_line_fields_of_the_critic_and_the_environment():
    from rlcore.run_report import critic_fields, environment_fields

    m = {"critic/vf_loss": 0.01234, "critic/explained_variance": 0.5, "critic/policy_frozen": 1.0}
    assert critic_fields(m) == "critic vf_loss 0.0123 ev 0.50 (policy frozen)"
    env = {"env/turns_mean": 1.75, "env/turns_max": 2.0, "env/tool_calls/calc": 5.0, "env/tool_failures/calc": 1.0,
           "env/tool_calls/python": 2.0, "env/tool_failures/python": 0.0, "env/end/done": 0.75,
           "env/end/max_turns": 0.25}
    assert environment_fields(env) == "env turns 1.8/2 tools 7 (1 failed) cut 25%"
    assert critic_fields({"reward_mean": 1.0}) == environment_fields({"reward_mean": 1.0}) == ""


FAST = ["training.steps=2", "rollout.n=4", "data.prompts_per_step=4", "output.plot=false",
        "output.tensorboard=false", "output.checkpoint_every=0"]


@pytest.mark.parametrize("config, overrides, shown", [
    ("tiny.yaml", ["algorithm.name=ppo"], re.compile(r"critic vf_loss \d+\.\d{4} ev -?\d")),
    ("tiny_tools.yaml", [], re.compile(r"env turns \d\.\d/\d")),
], ids=["ppo-critic", "tools-environment"])
def test_a_run_shows_critic_and_environment_metrics_on_its_step_line(tmp_path, capsys, monkeypatch, config,
                                                                     overrides, shown):
    monkeypatch.delenv("RLCORE_PLUGINS", raising=False)
    assert main(["train", str(ROOT / "examples" / config), "--output", str(tmp_path / "run"), *FAST,
                 *overrides]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if STEP_LINE.match(ln)]
    assert len(lines) == 2 and all(shown.search(ln) for ln in lines), lines


def test_without_tensorboard_a_run_says_so_once_and_names_the_extra(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.delenv("RLCORE_PLUGINS", raising=False)
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as without the tensorboard package
    fast = [o for o in FAST if not o.startswith("output.tensorboard")]  # the default: event files wanted
    assert main(["train", str(ROOT / "examples" / "tiny.yaml"), "--output", str(tmp_path / "run"), *fast]) == 0
    out = capsys.readouterr().out
    notes = [ln for ln in out.replace(str(tmp_path), "TMP").splitlines() if "tensorboard" in ln.lower()]
    assert len(notes) == 1, notes
    assert "not installed" in notes[0] and "pip install 'rlcore[tensorboard]'" in notes[0]
    assert "metrics.jsonl" in notes[0], "the note says where the metrics are instead"
    assert not (tmp_path / "run" / "tensorboard").exists()
