"""End-to-end `rlcore train` runs on CPU with core alone (and the example third-party plugin)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rlcore.testing.runs import main

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "examples" / "tiny.yaml")


def rows(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines() if line.strip()]


def mean(xs):
    xs = list(xs)
    return sum(xs) / len(xs)


@pytest.mark.slow
def test_tiny_grpo_reward_rises_with_verified_sync(tmp_path):
    out = tmp_path / "run"
    assert main(["train", TINY, "--output", str(out), "training.steps=80", "output.checkpoint_every=0"]) == 0
    r = rows(out)
    assert [x["step"] for x in r] == list(range(80))
    start, end = mean(x["reward_mean"] for x in r[:5]), mean(x["reward_mean"] for x in r[-10:])
    print(f"reward {start:.3f} (first 5 steps) -> {end:.3f} (last 10), wall {r[-1]['wall_seconds']:.1f}s")
    assert start < 0.3, "a model created from scratch starts near chance level"
    assert end >= 0.8 and end > start + 0.4
    assert all(x["sync_verified"] for x in r), "every push is verified"
    assert [x["weight_version"] for x in r] == list(range(1, 81))
    for key in ("step", "reward_mean", "sync_seconds", "wall_seconds", "entropy", "tokens_per_second"):
        assert key in r[0]
    assert max(x["logprob_mismatch_max"] for x in r) < 1e-4, "trainer and rollout agree on log-probs (fp32)"
    assert (out / "reward_curve.png").stat().st_size > 10_000
    assert list((out / "tensorboard").glob("events.out.tfevents.*")), "TensorBoard events are written"


@pytest.mark.slow
def test_plugins_list_changes_which_implementations_run(tmp_path):
    base = ["training.steps=3", "rollout.n=4", "data.prompts_per_step=4", "output.plot=false"]
    assert main(["train", TINY, "--output", str(tmp_path / "core"), *base]) == 0
    assert not any(k.startswith("example/") for k in rows(tmp_path / "core")[0])

    assert main(["train", TINY, "--output", str(tmp_path / "ext"), *base, "plugins=[example]",
                 "forward.name=example-naive", "example.length_penalty=0.1"]) == 0
    r = rows(tmp_path / "ext")
    # the third-party head ran in every micro-batch of every phase (old_logprob + train) ...
    assert all(x["example/forward_calls"] >= 2 for x in r)
    # ... its postprocess chain contributed a metric and a loss term
    assert "example/response_tokens" in r[0] and "loss/example/length_penalty" in r[0]


@pytest.mark.slow
def test_killed_run_resumes_from_its_checkpoint(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "rlcore.cli", "train", TINY, "--output", str(out), "training.steps=400",
           "output.checkpoint_every=4", "output.plot=false"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline:
        if metrics.exists() and metrics.read_text().count("\n") >= 10:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_before = len(rows(out))
    assert 10 <= done_before < 400, "the run was killed mid-way"

    assert main(["train", TINY, "--output", str(out), "--resume", "training.steps=30",
                 "output.checkpoint_every=4", "output.plot=false"]) == 0
    steps = [x["step"] for x in rows(out)]
    assert steps == list(range(30)), "every step exactly once, none lost, none duplicated"
    r = rows(out)
    assert [x["weight_version"] for x in r] == list(range(1, 31))
    assert r[-1]["wall_seconds"] > r[0]["wall_seconds"]


@pytest.mark.slow
def test_disk_sync_and_sequence_loss_with_kl(tmp_path):
    out = tmp_path / "disk"
    assert main(["train", TINY, "--output", str(out), "training.steps=4", "sync.name=disk", "algorithm.kl_coef=0.05",
                 "algorithm.loss_agg=seq-mean-token-mean", "output.plot=false"]) == 0
    r = rows(out)
    assert all(x["sync_verified"] for x in r)
    assert r[-1]["kl"] > 0, "the KL to the frozen reference grows once the policy moves"
    assert sorted(p.name for p in (out / "sync").iterdir()) == ["v3", "v4"], "disk sync keeps the last two versions"


REPLAY_PLUGIN = """
from rlcore import PLUGIN_API, hookimpl
from rlcore.types import RouterDecision, PostprocessResult
CALLS = {"replayed": 0}
@hookimpl
def router_hook(call):
    routes = call.micro_batch.batch.routes() if call.micro_batch else None  # compact ids decoded, -1 = native
    if routes is None:
        return None
    CALLS["replayed"] += 1
    return RouterDecision(indices=routes[:, call.routed_index].long())
@hookimpl
def step_end(ctx):
    n, CALLS["replayed"] = CALLS["replayed"], 0
    return {"replay/router_calls": float(n)}
"""


@pytest.mark.slow
def test_moe_rollout_routes_replayed_in_training(tmp_path, fake_distribution):
    fake_distribution("rlcore-replay-demo", "0.0.1", {"replaydemo": "replaydemo_mod"}, {"replaydemo_mod": REPLAY_PLUGIN})
    out = tmp_path / "moe"
    assert main(["train", TINY, "--output", str(out), "training.steps=3", "plugins=[replaydemo]",
                 "engine.model.tiny.arch=qwen3_moe", "rollout.return_routed_experts=true", "output.plot=false"]) == 0
    r = rows(out)
    # 2 MoE layers x (old_logprob + train) micro-batches: the rollout's routes were replayed
    assert all(x["replay/router_calls"] >= 4 for x in r)
    assert max(x["logprob_mismatch_max"] for x in r) < 1e-4
