"""The ``replay`` plugin selected by config: config errors, and GRPO runs on a tiny MoE (hf engine,
local rollout) with R3 and R2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rlcore.errors import ConfigError
from rlcore.stack import load_stack
from rlcore.testing.runs import main

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


SGLANG_R3 = ["plugins=[replay,sglang]", "rollout.backend=sglang", "sync.name=sglang-disk", "replay.mode=R3"]


def test_r3_with_sglang_eagle_topk_above_one_is_refused():
    with pytest.raises(ConfigError, match="speculative_eagle_topk=4 > 1 SGLang returns the routes of the wrong KV"):
        load_stack(TINY_MOE, [*SGLANG_R3, "sglang.speculative_algorithm=EAGLE", "sglang.speculative_eagle_topk=4"])


@pytest.mark.parametrize("overrides,why", [
    # top-k left to SGLang: it chooses 4 for most architectures
    (["sglang.speculative_algorithm=EAGLE3"], "speculative_eagle_topk is not set, so SGLang chooses it"),
    # the flags given as launch_args, in both spellings
    (["sglang.launch_args=[--speculative-algorithm,NEXTN,--speculative-eagle-topk=2]"], "speculative_eagle_topk=2"),
    (["sglang.launch_args=[--speculative-algorithm=NGRAM]"], "all-zero routes"),
    # the algorithm as a setting, the top-k in launch_args
    (["sglang.speculative_algorithm=EAGLE", "sglang.launch_args=[--speculative-eagle-topk,3]"],
     "speculative_eagle_topk=3"),
    # top-k 1: rlcore-sglang refuses any speculative decoding with routed experts at start; say so now
    (["sglang.speculative_algorithm=EAGLE", "sglang.speculative_eagle_topk=1"], "does not count the speculative verify"),
])
def test_r3_with_sglang_speculative_decoding_is_refused_at_config_time_saying_why(overrides, why):
    with pytest.raises(ConfigError, match=why) as err:
        load_stack(TINY_MOE, [*SGLANG_R3, *overrides])
    assert "replay.mode: R2" in str(err.value)


def test_r3_with_sglang_without_speculation_and_r2_with_speculation_are_accepted():
    assert load_stack(TINY_MOE, SGLANG_R3).config.replay.mode == "R3"
    s = load_stack(TINY_MOE, ["plugins=[replay,sglang]", "rollout.backend=sglang", "sync.name=sglang-disk",
                              "replay.mode=R2", "algorithm.old_logprobs=recompute", "rollout.return_routed_experts=false",
                              "sglang.speculative_algorithm=EAGLE", "sglang.speculative_eagle_topk=4"])
    assert s.config.replay.mode == "R2"


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


def test_mismatch_off_under_r2_is_a_config_error_saying_why():
    with pytest.raises(ConfigError, match="under R2 that pass routes natively"):
        stack("replay.mode=R2", "algorithm.old_logprobs=recompute", "replay.mismatch_off=true")


@pytest.mark.slow
def test_mismatch_with_replay_off_and_on_per_step(tmp_path):
    """The rollout serves in bf16 (it routes some tokens otherwise than the fp32 trainer): the
    mismatch with replay on is core's logprob_mismatch (the replaying old-log-prob pass); the
    extra native forward's mismatch is larger."""
    import sys

    sys.path.insert(0, str(ROOT / "plugins" / "replay" / "bench"))
    from mismatch_on_off import run

    r = run(2, tmp_path, prompts=4)
    assert len(r) == 2
    for x in r:
        assert x["replay/logprob_mismatch_on_mean"] == pytest.approx(x["logprob_mismatch_mean"], rel=1e-5, abs=1e-7)
        assert x["replay/logprob_mismatch_on_max"] == pytest.approx(x["logprob_mismatch_max"], rel=1e-5, abs=1e-7)
        assert x["replay/logprob_mismatch_off_mean"] > 0 and x["replay/agreement"] < 1.0
    assert sum(x["replay/logprob_mismatch_off_max"] for x in r) > sum(x["replay/logprob_mismatch_on_max"] for x in r)
    assert sum(x["replay/logprob_mismatch_off_mean"] for x in r) > sum(x["replay/logprob_mismatch_on_mean"] for x in r)


@pytest.mark.slow
def test_mismatch_off_with_the_loss_formed_inside_the_fused_head(tmp_path):
    """rlcore-fused's ``fused_loss`` head forms the loss itself in the train phase; the extra
    native forward of ``mismatch_off`` runs in the old-log-prob pass only, where no loss is asked
    for, so both features hold in one run."""
    import sys

    pytest.importorskip("rlcore_fused")
    sys.path.insert(0, str(ROOT / "plugins" / "replay" / "bench"))
    from mismatch_on_off import run

    calls: list = []
    r = run(2, tmp_path, prompts=4, extra=("plugins=[fused,replay]", "forward.name=fused"), head_calls=calls)
    assert len(r) == 2
    with_loss = [c for c in calls if c.loss is not None]
    assert with_loss and len(with_loss) < len(calls)  # train micro-batches got the loss, the others did not
    for x in r:
        assert x["replay/logprob_mismatch_on_mean"] == pytest.approx(x["logprob_mismatch_mean"], rel=1e-5, abs=1e-7)
        assert x["replay/logprob_mismatch_off_mean"] > 0 and x["replay/agreement"] < 1.0
    assert sum(x["replay/logprob_mismatch_off_mean"] for x in r) > sum(x["replay/logprob_mismatch_on_mean"] for x in r)
