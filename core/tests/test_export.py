"""The trained model out of a run: ``RUN/model`` at the end, ``checkpoints/step-N-hf`` at each
checkpoint, ``rlcore export RUN [--step N] [--out DIR]`` from any committed checkpoint, the
resolved config beside ``metrics.jsonl`` and the algorithm in the plot title.

One tiny run of three steps (checkpoint every two: checkpoints of steps 1 and 2) is shared by the
tests of this module; each export is compared with the engine's own tensors in this process."""

import json
import os
from pathlib import Path

import pytest
import torch
from rlcore import run_report as run_report_mod
from rlcore.cli import main
from rlcore.errors import ConfigError
from rlcore.export import begin_dir, write_dir
from rlcore.run_output import checkpoint_hf_dir, list_checkpoints
from rlcore.stack import load_stack
from rlcore.testing.models import assert_same_tensors, model_dir_tensors
from rlcore.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "tiny.yaml")
SMALL = ["training.steps=3", "output.checkpoint_every=2", "rollout.n=4", "data.prompts_per_step=4",
         "output.tensorboard=false", "output.progress=false", "training.lr=0.01"]
PROMPT = "3 4 5"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished run: (trainer, run directory, plot titles)."""
    out = tmp_path_factory.mktemp("export") / "run"
    titles: list[str] = []
    real_plot = run_report_mod.plot_rewards

    def plot_spy(out_dir, title=""):
        titles.append(title)
        return real_plot(out_dir, title=title)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(run_report_mod, "plot_rewards", plot_spy)
        trainer = Trainer(load_stack(TINY, SMALL + [f"output.dir={out}"]))
        summary = trainer.run()
    assert summary["completed"] and summary["steps"] == 3
    return trainer, out, titles


def test_the_run_ends_with_the_trained_policy_in_run_model(run):
    trainer, out, _ = run
    model_dir = out / "model"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (model_dir / name).is_file(), name
    final = {name: t.detach().cpu() for name, t in trainer.engine.export_hf_weights()}
    saved = model_dir_tensors(model_dir)
    assert_same_tensors(saved, final)
    initial = model_dir_tensors(out / "policy_hf")
    moved = max(float((saved[n] - initial[n]).abs().max()) for n in saved)
    assert moved > 0, "policy_hf holds the weights the rollout started from, RUN/model the trained ones"
    info = json.loads((model_dir / "rlcore_export.json").read_text())
    assert info["step"] == 2 and info["weight_version"] == 3
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")], "no staging directory is left"


def test_run_model_loads_with_transformers_and_computes_the_trainers_logits(run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer, out, _ = run
    model = AutoModelForCausalLM.from_pretrained(str(out / "model"), torch_dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(out / "model"))
    ids = tok(PROMPT, add_special_tokens=False, return_tensors="pt")["input_ids"]
    assert ids.tolist()[0] == trainer.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    trainer.engine.model.eval()
    with torch.no_grad():
        ours = trainer.engine.model(input_ids=ids).logits
        theirs = model(input_ids=ids).logits
    # the same float32 weights through the same transformers model class in one process: equal up
    # to the attention kernel transformers picks when loading (eager vs SDPA reorder the sums)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def test_each_checkpoint_has_its_hf_directory(run):
    trainer, out, _ = run
    assert [s for s, _ in list_checkpoints(out)] == [1, 2]
    for step in (1, 2):
        d = checkpoint_hf_dir(out, step)
        assert (d / "config.json").is_file() and (d / "tokenizer.json").is_file(), d
        assert json.loads((d / "rlcore_export.json").read_text())["step"] == step
    assert_same_tensors(model_dir_tensors(checkpoint_hf_dir(out, 2)), model_dir_tensors(out / "model"))
    assert not _same(model_dir_tensors(checkpoint_hf_dir(out, 1)), model_dir_tensors(checkpoint_hf_dir(out, 2)))


def _same(a, b):
    return sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)


def test_the_resolved_config_is_saved_beside_the_metrics(run):
    trainer, out, _ = run
    text = (out / "config.yaml").read_text()
    assert (out / "metrics.jsonl").is_file()
    again = load_stack(str(out / "config.yaml"))
    assert again.config.training.steps == 3 and again.config.algorithm.loss_agg == trainer.cfg.algorithm.loss_agg
    assert "checkpoint_every: 2" in text


def test_the_plot_title_names_the_algorithm(run):
    trainer, out, titles = run
    assert titles == ["rlcore grpo (token-mean) · hf/local"]
    assert (out / "reward_curve.png").is_file()


# ----------------------------------------------------------------------------- rlcore export ----

def test_export_of_a_step_equals_the_runs_own_checkpoint_export(run, tmp_path, capsys):
    _, out, _ = run
    dest = tmp_path / "step1"
    assert main(["export", str(out), "--step", "1", "--out", str(dest)]) == 0
    assert str(dest) in capsys.readouterr().out
    assert_same_tensors(model_dir_tensors(dest), model_dir_tensors(checkpoint_hf_dir(out, 1)))
    ref = checkpoint_hf_dir(out, 1)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (dest / name).read_text() == (ref / name).read_text(), name
    assert json.loads((dest / "rlcore_export.json").read_text())["step"] == 1


def test_export_without_a_step_takes_the_newest_checkpoint(run, capsys):
    _, out, _ = run
    try:
        assert main(["export", str(out)]) == 0
        dest = out / "export-step-2"
        assert_same_tensors(model_dir_tensors(dest), model_dir_tensors(out / "model"))
    finally:
        import shutil

        shutil.rmtree(out / "export-step-2", ignore_errors=True)


def test_export_errors_are_one_line_naming_what_is_missing(run, tmp_path, capsys):
    _, out, _ = run
    assert main(["export", str(out), "--step", "7", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "step 7" in err and "1, 2" in err, err
    assert not (tmp_path / "x").exists()

    assert main(["export", str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such run" in err and str(tmp_path / "absent") in err, err

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "mine.txt").write_text("keep")
    assert main(["export", str(out), "--step", "1", "--out", str(taken)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "exists" in err and str(taken) in err, err
    assert (taken / "mine.txt").read_text() == "keep"

    empty = tmp_path / "notarun"
    empty.mkdir()
    assert main(["export", str(empty)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "config.yaml" in err, err


# ---------------------------------------------------------------------------- the setting ----

def test_export_hf_setting_is_checked_and_never_skips_the_exports(tmp_path):
    with pytest.raises(ConfigError, match="output.export_hf") as exc:
        load_stack(TINY, ["output.export_hf=sometimes"])
    assert exc.value.key == "output.export_hf"
    out = tmp_path / "run"
    Trainer(load_stack(TINY, SMALL + ["training.steps=2", "output.plot=false", "output.export_hf=final",
                                      f"output.dir={out}"])).run()
    assert (out / "model" / "config.json").is_file()
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.endswith("-hf")]
    # the checkpoints still hold the weights: rlcore export writes them out afterwards
    assert main(["export", str(out), "--step", "1", "--out", str(tmp_path / "e")]) == 0
    assert_same_tensors(model_dir_tensors(tmp_path / "e"), model_dir_tensors(out / "model"))


# ------------------------------------------------------------------ atomic directory writes ----

def _write_files(names, fail_after=None):
    from safetensors.torch import save_file

    def write(d):
        for i, name in enumerate(names):
            if fail_after is not None and i == fail_after:
                raise OSError(28, "No space left on device")
            if name.endswith(".safetensors"):  # a commit checks that weights load
                save_file({"w": torch.arange(4.0)}, str(d / name))
            else:
                (d / name).write_text(name)
    return write


def test_a_failed_export_leaves_the_previous_directory_whole_and_no_staging(tmp_path):
    final = tmp_path / "model"
    write_dir(final, _write_files(["config.json", "model.safetensors"]), {"step": 1})
    with pytest.raises(OSError, match="No space"):
        write_dir(final, _write_files(["config.json", "model.safetensors"], fail_after=1), {"step": 2})
    assert sorted(p.name for p in final.iterdir()) == ["config.json", "model.safetensors", "rlcore_export.json"]
    assert json.loads((final / "rlcore_export.json").read_text())["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    write_dir(final, _write_files(["config.json", "model-00001.safetensors"]), {"step": 3})  # replaced whole
    assert sorted(p.name for p in final.iterdir()) == ["config.json", "model-00001.safetensors", "rlcore_export.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_leftovers_of_a_killed_export_are_cleared_or_put_back(tmp_path):
    final = tmp_path / "model"
    # killed mid-write: a half staging directory, nothing under the final name
    staging = begin_dir(final)
    (staging / "config.json").write_text("half")
    assert not final.exists()
    write_dir(final, _write_files(["config.json"]), {"step": 1})
    assert (final / "config.json").read_text() == "config.json"
    # killed between the two renames of the fallback swap: the good one is aside, none final
    os.rename(final, tmp_path / ".model.tmp-old")
    begin_dir(final)
    assert json.loads((final / "rlcore_export.json").read_text())["step"] == 1


def test_without_an_atomic_exchange_the_old_directory_stays_until_the_new_one_is_in_place(tmp_path, monkeypatch):
    import rlcore.export as export_mod

    monkeypatch.setattr(export_mod, "_exchange", lambda a, b: False)  # a system without renameat2
    final = tmp_path / "model"
    write_dir(final, _write_files(["a"]), {"step": 1})
    write_dir(final, _write_files(["b"]), {"step": 2})
    assert sorted(p.name for p in final.iterdir()) == ["b", "rlcore_export.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
