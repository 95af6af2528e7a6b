"""Reliability of `rlcore train` on CPU: non-finite values never reach the optimizer, the rollout
engine or a checkpoint; one run per output directory; bad checkpoints are one-line errors.

Each run is a few steps of the tiny model (about 2-4 s each on the CI machine)."""

import json
import math
from pathlib import Path

import pytest

from rlcore.cli import main
from rlcore.run_output import list_checkpoints, read_metrics

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


def test_resume_without_checkpoint_is_an_error(tmp_path, capsys):
    out = tmp_path / "run"
    assert _train(out, "training.steps=1", "output.checkpoint_every=0") == 0  # a final checkpoint only
    for p in (out / "checkpoints").iterdir():
        p.unlink()
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
    from rlcore.trainer import Trainer

    trainer = Trainer(load_stack(TINY, [f"output.dir={tmp_path / 'run'}", "training.steps=1", *SMALL]))
    with torch.no_grad():
        trainer.engine.model.model.embed_tokens.weight[0, 0] = math.inf
    with pytest.raises(NonFiniteError, match=r"\['model.embed_tokens.weight'\]\) before the rollout engine starts"):
        trainer.run()
    assert not (tmp_path / "run" / "policy_hf").exists(), "nothing was handed to the rollout engine"
