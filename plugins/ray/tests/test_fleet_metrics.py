"""A fleet's rollout and memory metrics carry each replica backend's own metrics, kept per replica
(``rollout/replica{i}_<name>``): the rollout metrics of its last ``generate`` beside the weight
version each replica reported, and the memory metrics of its last release (what core logs after
releasing the KV cache before a push; before, the fleet had none, so vLLM's KV-cache bytes freed in
each replica were lost under Ray).

Two real replicas (``RolloutReplica`` actors, the local backend: drafting with the model's MTP layer,
so it reports draft acceptance; reporting its last generate's KV-cache peak and what its release
freed) on a simulated Ray node."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest
import ray
from rlcore.engines.tiny import save_tiny
from rlcore.stack import config_yaml, load_stack
from rlcore.testing.models import TinyModelConfig
from rlcore.types import Prompt, SamplingSettings
from rlcore_ray.fleet import RolloutFleet, RolloutReplica

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny.yaml"
MIMO = TinyModelConfig(hidden_size=32, head_dim=16, intermediate_size=48, mtp_layers=2, seed=3)
DENSE = TinyModelConfig(hidden_size=32, head_dim=16, intermediate_size=48, seed=3)
PROMPTS = [Prompt(ids=[1, 2, 3], index=i) for i in range(4)]


@pytest.fixture(scope="module")
def one_node():
    from rlcore_ray.testing import simulated_ray_nodes

    with simulated_ray_nodes(1, 2) as cluster:
        yield cluster


@contextmanager
def two_replica_fleet(tmp_path: Path, tiny: TinyModelConfig, overrides: list[str]):
    """A started fleet of two replica actors serving a tiny model saved under ``tmp_path``, and
    the replicas (killed on the way out)."""
    model_dir = tmp_path / "tiny"
    save_tiny(model_dir, tiny, ["a", "b", "c"])
    text = config_yaml(load_stack(str(EXAMPLE), [f"output.dir={tmp_path}", *overrides]))
    replicas = [ray.remote(RolloutReplica).options(num_cpus=0).remote(text, i, str(tmp_path)) for i in range(2)]
    try:
        fleet = RolloutFleet(replicas, timeout_s=120)
        fleet.start(str(model_dir), version=0)
        yield fleet, replicas
    finally:
        for r in replicas:
            ray.kill(r)


def test_each_replicas_own_metrics_are_forwarded_per_replica(one_node, tmp_path):
    with two_replica_fleet(tmp_path, MIMO, ["engine.model.tiny.mtp_layers=2", "rollout.draft_depths=1"]) as (
            fleet, replicas):
        fleet.generate(PROMPTS, SamplingSettings(n=2, temperature=0.0, max_new_tokens=8, seed=1))
        metrics = fleet.rollout_metrics()
        own = [ray.get(r.rollout_metrics.remote()) for r in replicas]
        for i, replica_metrics in enumerate(own):
            assert "rollout/acceptance_d1" in replica_metrics  # the backend reports its drafting
            for name, value in replica_metrics.items():
                assert metrics[f"rollout/replica{i}_{name.removeprefix('rollout/')}"] == value
            assert metrics[f"rollout/replica{i}_weight_version"] == 0.0
        assert "rollout/acceptance_d1" not in metrics  # never reduced across replicas under the plain name
        assert len(metrics) == 2 + sum(len(m) for m in own)


def test_each_replicas_release_metrics_are_forwarded_per_replica(one_node, tmp_path):
    with two_replica_fleet(tmp_path, DENSE, []) as (fleet, replicas):
        fleet.generate(PROMPTS, SamplingSettings(n=2, temperature=1.0, max_new_tokens=8, seed=1))
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
