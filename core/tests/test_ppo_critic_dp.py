"""PPO's critic under data parallelism (2 ranks, gloo, spawn): every rank runs the critic on the
whole step batch, so after a step the critic equals a single rank's (the policy's update is the
all-reduced one, checked by test_cluster_dp.py)."""

from pathlib import Path

import pytest
from rlcore.run_output import load_checkpoint, read_metrics
from rlcore.stack import load_stack

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny.yaml"
STEP = ["algorithm.name=ppo", "training.steps=1", "rollout.n=4", "data.prompts_per_step=6",
        "training.micro_batch_tokens=64", "output.progress=false", "output.tensorboard=false", "output.plot=false"]


def _rank_main(rank: int, port: int, out: str) -> None:
    from rlcore.parallel.worker import config_yaml, run_rank

    stack = load_stack(str(EXAMPLE), [*STEP, f"output.dir={out}"])
    run_rank(config_yaml(stack.config), rank, 2, f"127.0.0.1:{port}")


@pytest.mark.slow
def test_two_data_parallel_ranks_train_the_critic_as_one(tmp_path, gloo_ranks):
    from rlcore.trainer import Trainer

    one, two = tmp_path / "one", tmp_path / "two"
    Trainer(load_stack(str(EXAMPLE), [*STEP, f"output.dir={one}"])).run()
    gloo_ranks(_rank_main, str(two)).check()
    a, b = load_checkpoint(one)[0]["critic"], load_checkpoint(two)[0]["critic"]
    for part in ("trunk", "head"):
        # the same batch, the same values, the same update: float32 sums in the same order
        assert max(float((a[part][k] - b[part][k]).abs().max()) for k in a[part]) < 1e-6, part
    ma, mb = read_metrics(one)[0], read_metrics(two)[0]
    for key in ("critic/vf_loss", "critic/explained_variance", "critic/grad_norm", "reward_mean"):
        assert ma[key] == pytest.approx(mb[key], rel=1e-5, abs=1e-7), key
