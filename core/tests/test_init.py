"""`rlcore init`: a starter config for a user who has only the wheels (no checkout, so no
examples/): one of the example configs shipped as package data, verbatim under a header, never
written over an existing file unless --force, and one that `rlcore check` and `rlcore train` run."""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

import pytest
import yaml
from rlcore.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_every_example_config_is_package_data_read_through_importlib_resources():
    """rlcore/examples is the repository's examples/ (one copy): every config is there."""
    shipped = {p.name: p.read_text() for p in (files("rlcore") / "examples").iterdir() if p.name.endswith(".yaml")}
    repo = {p.name: p.read_text() for p in (ROOT / "examples").glob("*.yaml")}
    assert shipped == repo and "tiny.yaml" in shipped


def test_init_writes_the_tiny_example_verbatim_and_check_accepts_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["init"]) == 0
    written = (tmp_path / "rlcore.yaml").read_text()
    example = (ROOT / "examples" / "tiny.yaml").read_text()
    header, _, body = written.partition("#\n")
    assert body == example, "the starter config is examples/tiny.yaml under a header of comments"
    assert all(line.startswith("#") for line in header.splitlines())
    assert yaml.safe_load(written) == yaml.safe_load(example)
    assert "rlcore check rlcore.yaml" in capsys.readouterr().out
    assert main(["check", "rlcore.yaml"]) == 0
    assert "config OK" in capsys.readouterr().out


def test_init_never_writes_over_a_file_unless_forced(tmp_path, capsys):
    target = tmp_path / "mine.yaml"
    target.write_text("plugins: [mine]\n")
    assert main(["init", str(target)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"rlcore: error: {target} exists; pass --force to replace it, or give another path"
    assert target.read_text() == "plugins: [mine]\n"
    # a dangling symlink is refused too (its target would be created)
    link = tmp_path / "link.yaml"
    link.symlink_to(tmp_path / "elsewhere.yaml")
    assert main(["init", str(link)]) == 2
    assert not (tmp_path / "elsewhere.yaml").exists()
    assert main(["init", str(target), "--force", "--example", "tiny_tools"]) == 0
    assert yaml.safe_load(target.read_text()) == yaml.safe_load((ROOT / "examples" / "tiny_tools.yaml").read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.yaml", "mine.yaml"], "no temporary file is left"


@pytest.mark.parametrize("argv, says", [
    (["init", "--example", "nope"], "--example nope: no such example config; the shipped ones are "),
    (["init", "{tmp}"], "is a directory; give the file to write"),
    (["init", "{tmp}/absent/x.yaml"], "absent of "),
])
def test_init_errors_are_one_line(tmp_path, capsys, argv, says):
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("rlcore: error: ") and says in err, err


def test_init_list_names_every_shipped_example(capsys):
    assert main(["init", "--list"]) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert names == sorted(p.stem for p in (ROOT / "examples").glob("*.yaml"))


def test_train_runs_the_written_starter_config(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RLCORE_PLUGINS", raising=False)
    cfg = tmp_path / "start.yaml"
    assert main(["init", str(cfg)]) == 0
    out = tmp_path / "run"
    assert main(["train", str(cfg), "--output", str(out), "training.steps=2", "rollout.n=2",
                 "data.prompts_per_step=2", "output.plot=false", "output.tensorboard=false"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and all("reward_mean" in r for r in rows)
