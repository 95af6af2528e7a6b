"""Every example config passes `rlcore check` (the configs users copy must resolve: plugins
installed in the development venv, sections valid, constraints met), and the plugin stack of
examples/tiny_moe_fused_replay.yaml (fused head + R3 replay on a MoE model) trains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rlcore.testing.runs import main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def test_there_are_examples():
    assert len(EXAMPLES) >= 7, EXAMPLES


def example_overrides(path: Path, tmp_path: Path) -> list[str]:
    """What an example leaves to its user: the files of examples/gsm8k_*.yaml (made by
    examples/gsm8k_tiny/make_data.py in ``tmp_path``) and a placeholder engine.model.path (the
    tiny model created locally stands in)."""
    out = []
    if "data.train_files" in path.read_text() or "train_files:" in path.read_text():
        import importlib.util

        spec = importlib.util.spec_from_file_location("make_data", ROOT / "examples" / "gsm8k_tiny" / "make_data.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        paths = mod.write(tmp_path / "data", train=64, val=16)
        out += [f"data.train_files={paths['train']}", f"data.val_files={paths['val']}"]
    if "path: /path/to/" in path.read_text():
        out += ["engine.model.path=null", "rollout.max_new_tokens=64"]  # the tiny model's 512 positions
    return out


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_passes_rlcore_check(path, capsys, tmp_path):
    import torch

    args = ["check", str(path), "--json", *example_overrides(path, tmp_path)]
    if "device: cuda" in path.read_text() and not torch.cuda.is_available():
        # a GPU example on a machine without one: check refuses it as train would, in one line
        assert main(args) == 2
        assert "rlcore: error: engine.device=cuda but " in capsys.readouterr().err
        args.append("engine.device=cpu")  # and the rest of it resolves
    assert main(args) == 0, capsys.readouterr()
    shown = json.loads(capsys.readouterr().out)
    assert shown["engine"]["name"] and shown["platform"]["name"] in ("cpu", "cuda", "npu")


def _promises_replay(path: Path) -> bool:
    """Its comments say it replays routes (tiny_moe.yaml only says a replay plugin could)."""
    comments = " ".join(line.split("#", 1)[1] for line in path.read_text().splitlines() if "#" in line).lower()
    return ("replay" in comments or " r3" in comments) and "without one" not in comments


def test_every_example_that_promises_replay_activates_it():
    from rlcore.config import raw_plugins, read_raw

    promising = [p for p in EXAMPLES if _promises_replay(p)]
    assert {"sglang_moe_mtp.yaml", "tiny_moe_fused_replay.yaml"} <= {p.name for p in promising}
    for path in promising:
        assert "replay" in raw_plugins(read_raw(path, ())), f"{path.name} promises routing replay but does not activate it"


def test_fused_and_replay_stack_is_shown_by_check(capsys):
    path = ROOT / "examples" / "tiny_moe_fused_replay.yaml"
    assert main(["check", str(path), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    chosen = [p["name"] for p in shown["plugins"] if not p["distribution"].startswith("rlcore ")]
    assert chosen == ["fused", "replay"]  # the config's plugins, in its order, after core's built-ins
    assert shown["forward_fn"]["name"] == "fused" and shown["forward_fn"]["distribution"].startswith("rlcore-fused")
    assert shown["chains"]["router_hook"] == ["replay"]
    assert "replay" in shown["chains"]["postprocess"]
    assert main(["check", str(path)]) == 0  # the human-readable table as well
    text = capsys.readouterr().out
    assert "fused" in text and "replay" in text


def test_fused_and_replay_stack_trains_with_replay_on_a_moe_model(tmp_path):
    out = tmp_path / "run"
    assert main(["train", str(ROOT / "examples" / "tiny_moe_fused_replay.yaml"), "--output", str(out),
                 "training.steps=2", "data.prompts_per_step=4", "output.plot=false", "output.tensorboard=false"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert len(rows) == 2
    for row in rows:
        assert 0.5 < row["replay/coverage"] < 1.0  # every token but each sequence's last is replayed
        assert row["replay/forwards"] >= 2  # the old-log-prob pass and the update replayed
        assert 0.5 < row["replay/agreement"] <= 1.0
