"""A fleet's rollout metrics carry each replica backend's own metrics of its last ``generate``, kept
per replica (``rollout/replica{i}_<name>``), beside the weight version each replica reported.

Two real replicas (``RolloutReplica`` actors, the local backend drafting with the model's MTP layer,
so it reports draft acceptance) on a simulated Ray node."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
from rlcore.config import TinyModelConfig
from rlcore.engines.tiny import save_tiny
from rlcore.stack import config_yaml, load_stack
from rlcore.types import Prompt, SamplingSettings
from rlcore_ray.fleet import RolloutFleet, RolloutReplica

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny.yaml"
TINY = TinyModelConfig(hidden_size=32, head_dim=16, intermediate_size=48, mtp_layers=2, seed=3)


@pytest.fixture(scope="module")
def one_node():
    from rlcore_ray.testing import simulated_ray_nodes

    with simulated_ray_nodes(1, 2) as cluster:
        yield cluster


def test_each_replicas_own_metrics_are_forwarded_per_replica(one_node, tmp_path):
    model_dir = tmp_path / "mimo"
    save_tiny(model_dir, TINY, ["a", "b", "c"])
    text = config_yaml(load_stack(str(EXAMPLE), [f"output.dir={tmp_path}", "engine.model.tiny.mtp_layers=2",
                                                 "rollout.draft_depths=1"]))
    replicas = [ray.remote(RolloutReplica).options(num_cpus=0).remote(text, i, str(tmp_path)) for i in range(2)]
    try:
        fleet = RolloutFleet(replicas, timeout_s=120)
        fleet.start(str(model_dir), version=0)
        prompts = [Prompt(ids=[1, 2, 3], index=i) for i in range(4)]
        fleet.generate(prompts, SamplingSettings(n=2, temperature=0.0, max_new_tokens=8, seed=1))
        metrics = fleet.rollout_metrics()
        own = [ray.get(r.rollout_metrics.remote()) for r in replicas]
        for i, replica_metrics in enumerate(own):
            assert "rollout/acceptance_d1" in replica_metrics  # the backend reports its drafting
            for name, value in replica_metrics.items():
                assert metrics[f"rollout/replica{i}_{name.removeprefix('rollout/')}"] == value
            assert metrics[f"rollout/replica{i}_weight_version"] == 0.0
        assert "rollout/acceptance_d1" not in metrics  # never reduced across replicas under the plain name
        assert len(metrics) == 2 + sum(len(m) for m in own)
    finally:
        for r in replicas:
            ray.kill(r)
