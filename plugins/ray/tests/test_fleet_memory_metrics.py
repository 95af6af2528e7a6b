"""A fleet's memory metrics (what core logs after releasing the KV cache before a push) carry each
replica backend's own ``memory_metrics()``, kept per replica (``rollout/replica{i}_<name>``); before,
the fleet had none, so vLLM's KV-cache bytes freed in each replica were lost under Ray.

Two real replicas (``RolloutReplica`` actors, the local backend, which reports its last generate's
KV-cache peak and what its release freed) on a simulated Ray node."""

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
TINY = TinyModelConfig(hidden_size=32, head_dim=16, intermediate_size=48, seed=3)


@pytest.fixture(scope="module")
def one_node():
    from rlcore_ray.testing import simulated_ray_nodes

    with simulated_ray_nodes(1, 2) as cluster:
        yield cluster


def test_each_replicas_release_metrics_are_forwarded_per_replica(one_node, tmp_path):
    model_dir = tmp_path / "tiny"
    save_tiny(model_dir, TINY, ["a", "b", "c"])
    text = config_yaml(load_stack(str(EXAMPLE), [f"output.dir={tmp_path}"]))
    replicas = [ray.remote(RolloutReplica).options(num_cpus=0).remote(text, i, str(tmp_path)) for i in range(2)]
    try:
        fleet = RolloutFleet(replicas, timeout_s=120)
        fleet.start(str(model_dir), version=0)
        prompts = [Prompt(ids=[1, 2, 3], index=i) for i in range(4)]
        fleet.generate(prompts, SamplingSettings(n=2, temperature=1.0, max_new_tokens=8, seed=1))
        fleet.pause()
        fleet.release_memory(frozenset({"kv_cache"}))
        metrics = fleet.memory_metrics()
        own = [ray.get(r.memory_metrics.remote()) for r in replicas]
        for i, replica_metrics in enumerate(own):
            assert "rollout/kv_cache_freed_bytes" in replica_metrics  # measured by the release (0 for the local
            assert replica_metrics["rollout/kv_cache_peak_bytes"] > 0  # backend, whose cache lives per generate)
            for name, value in replica_metrics.items():
                assert metrics[f"rollout/replica{i}_{name.removeprefix('rollout/')}"] == value
        assert len(metrics) == sum(len(m) for m in own)  # nothing reduced under the plain names
        fleet.resume_memory(frozenset({"kv_cache"}))
        fleet.resume()
    finally:
        for r in replicas:
            ray.kill(r)
