"""Validation (``validation.*``, rlcore/validation.py) and examples/gsm8k_tiny (issue 41 items 4 and
7): the tiny model learns the word problems of examples/gsm8k_tiny/make_data.py from scratch on a
CPU, as val/accuracy (greedy, on the val split) says; validation leaves training as it is."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from rlcore.errors import ConfigError
from rlcore.stack import load_config
from rlcore.testing.runs import main
from rlcore.validation import pass_at_k, val_metrics

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "gsm8k_tiny.yaml")
QUIET = ["output.plot=false", "output.tensorboard=false", "output.progress=false"]


def make_data(out: Path) -> list[str]:
    """The example's files in ``out``; the overrides that name them."""
    spec = importlib.util.spec_from_file_location("gsm8k_tiny_make_data", ROOT / "examples" / "gsm8k_tiny" / "make_data.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    paths = mod.write(out)
    return [f"data.train_files={paths['train']}", f"data.val_files={paths['val']}"]


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    m = val_metrics([1.0, 0.0], [[1.0, 0.0, 0.0], [0.5, 0.5, 0.0]], threshold=1.0)
    assert m["val/accuracy"] == 0.5 and m["val/pass@k"] == 0.5 and m["val/mean@k"] == pytest.approx(2 / 6)


def test_validation_needs_val_files_and_the_sync_loop(tmp_path):
    with pytest.raises(ConfigError, match="validation.every_steps") as err:
        load_config(str(ROOT / "examples" / "tiny.yaml"), ["validation.every_steps=2"])
    assert "data.val_files" in str(err.value) and "\n" not in str(err.value)
    files = make_data(tmp_path)
    with pytest.raises(ConfigError, match="validation.every_steps: validation runs with loop.mode=sync"):
        load_config(EXAMPLE, [*files, "loop.mode=one_step_off"])
    load_config(EXAMPLE, files)


@pytest.mark.slow
def test_validation_does_not_change_training_and_resumes(tmp_path):
    files = make_data(tmp_path / "data")
    base = [*files, *QUIET, "training.steps=4", "data.prompts_per_step=4", "rollout.n=4", "validation.n=3",
            "validation.max_prompts=8"]
    assert main(["train", EXAMPLE, "--output", str(tmp_path / "off"), *base, "validation.every_steps=0"]) == 0
    assert main(["train", EXAMPLE, "--output", str(tmp_path / "on"), *base, "validation.every_steps=2"]) == 0
    assert main(["train", EXAMPLE, "--output", str(tmp_path / "cut"), *base, "validation.every_steps=2",
                 "training.steps=2", "output.checkpoint_every=1"]) == 0
    assert main(["train", EXAMPLE, "--output", str(tmp_path / "cut"), "--resume", *base,
                 "validation.every_steps=2"]) == 0
    off, on, cut = rows(tmp_path / "off"), rows(tmp_path / "on"), rows(tmp_path / "cut")
    assert [r["reward_mean"] for r in on] == [r["reward_mean"] for r in off]  # the same samples, the same training
    assert [r["grad_norm"] for r in on] == [r["grad_norm"] for r in off]
    assert [r["step"] for r in on if "val/accuracy" in r] == [0, 2, 3]  # before 0 and 2, after the last
    assert [r["val/weight_version"] for r in on if "val/accuracy" in r] == [0, 2, 4]
    for r in on:
        if "val/accuracy" in r:
            assert r["val/prompts"] == 8 and r["val/k"] == 3 and 0 <= r["val/pass@k"] <= 1 and r["val/seconds"] > 0
    # the resumed run: the same training, the same validations (its first segment also validated
    # the end of its own training.steps=2, after step 1)
    assert [r["reward_mean"] for r in cut] == [r["reward_mean"] for r in on]
    assert [r["step"] for r in cut if "val/accuracy" in r] == [0, 1, 2, 3]
    keys = sorted({k for r in on for k in r if k.startswith("val/") and k != "val/seconds"})
    assert [[r[k] for k in keys] for r in cut if r["step"] != 1] == [[r.get(k) for k in keys] for r in on
                                                                      if r["step"] != 1]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_gsm8k_tiny_learns(tmp_path, seed):
    """About 20-40 s on an idle CPU (0.2-0.4 s a step); minutes on a loaded machine."""
    files = make_data(tmp_path / "data")
    out = tmp_path / "run"
    assert main(["train", EXAMPLE, "--output", str(out), *files, *QUIET, "training.steps=80",
                 "validation.every_steps=40", f"training.seed={seed}"]) == 0
    val = [(r["step"], r["val/accuracy"]) for r in rows(out) if "val/accuracy" in r]
    print(f"seed {seed}: val/accuracy {val}")
    assert [s for s, _ in val] == [0, 40, 79]
    # seen: 0.125 -> 0.48, 0.59, 0.52, 0.47 (seeds 0-3)
    assert val[-1][1] >= val[0][1] + 0.2, val
