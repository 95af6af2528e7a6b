"""PPO's critic on the megatron engine: the value model under TP=2 and EP=2 (CPU, gloo, 2 ranks
through torchrun) gives the values, gradients, gradient norm and updated values of a world of
one; and ``algorithm.name=ppo`` trains with the megatron engine."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.engine("megatron"), pytest.mark.slow]

WORKER = Path(__file__).with_name("critic_parallel_worker.py")


@pytest.mark.parametrize("model,tp,ep", [("dense_kv2", 2, 1), ("moe_mtp", 1, 2)])
def test_critic_parallel_matches_a_single_rank(megatron_dirs, run_worker, tmp_path, model, tp, ep):
    par = run_worker(WORKER, megatron_dirs[model], tmp_path / "par.pt", tp, ep, world=2)
    one = run_worker(WORKER, megatron_dirs[model], tmp_path / "one.pt", 1, 1, world=1)
    assert float((par["values"] - one["values"]).abs().max()) < 1e-5
    assert set(par["grads"]) == set(one["grads"])
    assert max(float((par["grads"][k] - one["grads"][k]).abs().max()) for k in one["grads"]) < 1e-5
    assert abs(par["grad_norm"] - one["grad_norm"]) < 1e-5 * one["grad_norm"]
    assert float((par["after"] - one["after"]).abs().max()) < 1e-5
    assert float((one["after"] - one["values"]).abs().max()) > 1e-4, "the step moved the critic"


def test_ppo_trains_with_the_megatron_engine(tmp_path):
    from rlcore.testing.runs import main, read_metrics

    example = Path(__file__).resolve().parents[3] / "examples" / "megatron_tiny.yaml"
    assert main(["train", str(example), "--output", str(tmp_path), "algorithm.name=ppo", "training.steps=3",
                 "data.prompts_per_step=4", "rollout.n=4", "output.checkpoint_every=0", "output.plot=false",
                 "output.progress=false"]) == 0
    rows = read_metrics(tmp_path)
    assert len(rows) == 3
    assert all(r["critic/grad_norm"] > 0 and "critic/explained_variance" in r for r in rows)
