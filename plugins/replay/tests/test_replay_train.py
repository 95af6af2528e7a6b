"""The ``replay`` plugin selected by config: config errors, and GRPO runs on a tiny MoE (hf engine,
local rollout) with R3 and R2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rlcore.cli import main
from rlcore.errors import ConfigError
from rlcore.stack import load_stack

ROOT = Path(__file__).resolve().parents[3]
TINY_MOE = str(ROOT / "examples" / "tiny_moe.yaml")


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def stack(*overrides: str):
    return load_stack(TINY_MOE, ["plugins=[replay]", *overrides])


def test_stack_shows_replay_and_its_defaults():
    s = stack("replay.mode=R3")
    assert "replay" in s.plugins.active and s.config.replay.on_missing == "error"


@pytest.mark.parametrize("mode", ["R2+R3", "r3,r2"])
def test_r2_and_r3_together_is_a_config_error_saying_why(mode):
    with pytest.raises(ConfigError, match="R2 and R3 cannot be combined. R3 already replays"):
        stack(f"replay.mode='{mode}'")


def test_r3_without_routes_from_the_rollout_is_a_config_error():
    with pytest.raises(ConfigError, match="set rollout.return_routed_experts: true"):
        stack("replay.mode=R3", "rollout.return_routed_experts=false")


def test_r2_without_recomputed_old_logprobs_is_a_config_error():
    with pytest.raises(ConfigError, match="replay.mode R2 replays the routes of the old-log-prob pass"):
        stack("replay.mode=R2")  # old_logprobs auto -> rollout (no mismatch correction)
    assert stack("replay.mode=R2", "algorithm.old_logprobs=recompute").config.replay.mode == "R2"


def test_bad_values_name_the_key():
    with pytest.raises(ConfigError, match="replay.on_missing must be one of error, native"):
        stack("replay.on_missing=skip")
    with pytest.raises(ConfigError, match="replay.mtp must be one of replay, native"):
        stack("replay.mtp=decoder")


def test_r3_with_sglang_eagle_topk_above_one_is_refused():
    with pytest.raises(ConfigError, match="speculative_eagle_topk=4"):
        load_stack(TINY_MOE, ["plugins=[replay,sglang]", "rollout.backend=sglang", "sync.name=sglang-disk",
                              "replay.mode=R3", "sglang.speculative_algorithm=EAGLE",
                              "sglang.speculative_eagle_topk=4"])


def test_replay_needs_the_router_seam_and_routes_from_the_rollout():
    s = stack("replay.mode=R3")
    assert s.has("engine", "router_hook") and s.has("rollout_backend", "routed_experts")


@pytest.mark.slow
def test_grpo_r3_from_the_local_rollout(tmp_path):
    out = tmp_path / "r3"
    assert main(["train", TINY_MOE, "--output", str(out), "training.steps=2", "plugins=[replay]",
                 "replay.mode=R3", "replay.agreement=true", "output.plot=false", "output.tensorboard=false",
                 "data.prompts_per_step=4"]) == 0
    r = rows(out)
    for x in r:
        # 2 MoE layers; every token but each sequence's last is replayed
        assert 0.5 < x["replay/coverage"] < 1.0
        assert x["replay/forwards"] >= 2  # old_logprob + train micro-batches
        assert x["replay/missing_samples"] == 0
        # core packs them compactly: uint8 ids [T, 2 layers, top-2] + a [T, 2] native mask
        assert x["replay/bytes_per_token"] == 2 * 2 * 1 + 2 and x["replay/id_bytes"] == 1
        assert x["replay/agreement"] == pytest.approx(1.0, abs=0.02)  # same weights: native ≈ replayed
    assert max(x["logprob_mismatch_max"] for x in r) < 1e-4


@pytest.mark.slow
def test_grpo_r2(tmp_path):
    out = tmp_path / "r2"
    assert main(["train", TINY_MOE, "--output", str(out), "training.steps=2", "plugins=[replay]",
                 "replay.mode=R2", "algorithm.old_logprobs=recompute", "rollout.return_routed_experts=false",
                 "output.plot=false", "output.tensorboard=false", "data.prompts_per_step=4",
                 "algorithm.updates_per_step=2"]) == 0
    for x in rows(out):
        assert x["replay/coverage"] == 1.0  # the trainer recorded every token's route
        assert x["replay/bytes_per_token"] == 2 * 2 * 1 + 2  # uint8 ids + native mask
        assert x["replay/forwards"] >= 2  # both updates replayed


def _drop_routes_of_sample_1(monkeypatch):
    import dataclasses

    from rlcore.rollout_local import LocalRollout

    real = LocalRollout.generate

    def generate(self, prompts, params):
        samples = real(self, prompts, params)
        return [dataclasses.replace(s, routed_experts=None) if i == 1 else s for i, s in enumerate(samples)]

    monkeypatch.setattr(LocalRollout, "generate", generate)


@pytest.mark.slow
def test_samples_without_routes_are_an_error_naming_the_sample(tmp_path, monkeypatch, capsys):
    """Core used to drop every sample's routes when one lacked them, and training routed natively."""
    _drop_routes_of_sample_1(monkeypatch)
    assert main(["train", TINY_MOE, "--output", str(tmp_path / "x"), "training.steps=1", "plugins=[replay]",
                 "replay.mode=R3", "output.plot=false", "output.tensorboard=false", "data.prompts_per_step=2"]) != 0
    assert "no routed experts for sample(s) [1] of step 0" in capsys.readouterr().err


@pytest.mark.slow
def test_on_missing_native_routes_them_natively_and_counts_them(tmp_path, monkeypatch):
    _drop_routes_of_sample_1(monkeypatch)
    out = tmp_path / "native"
    assert main(["train", TINY_MOE, "--output", str(out), "training.steps=1", "plugins=[replay]",
                 "replay.mode=R3", "replay.on_missing=native", "output.plot=false", "output.tensorboard=false",
                 "data.prompts_per_step=2"]) == 0
    (x,) = rows(out)
    assert x["replay/missing_samples"] == 1.0
    assert x["replay/coverage"] < 1.0


def test_examples_that_promise_replay_activate_it():
    for name in ("sglang_moe_mtp.yaml",):
        s = load_stack(str(ROOT / "examples" / name))
        assert "replay" in s.plugins.active and s.config.replay.mode == "R3", name
