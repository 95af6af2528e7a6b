"""A third party's engine and rollout backend under Ray: rlcore-example-plugin (installed the way an
outsider's plugin is, from examples/third_party_plugin) registers ``outsider-hf`` (declares
``data_parallel``) and ``outsider-local`` (declares ``replica``). The ray launcher decides by those
declarations, not by names, so the tiny GRPO runs with two data-parallel trainer ranks and a rollout
replica on two simulated nodes, to completion, and what they do not declare is refused naming them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rlcore.errors import ConfigError
from rlcore.stack import load_stack
from rlcore.testing.runs import read_metrics

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny.yaml"
STEPS = 3
OUTSIDER = ["plugins=[example,ray]", "engine.name=outsider-hf", "rollout.backend=outsider-local",
            "cluster.backend=ray"]
RUN = [f"training.steps={STEPS}", "data.prompts_per_step=4", "rollout.n=4", "sync.bucket_mb=0.25",
       "output.progress=false", "output.tensorboard=false", "output.plot=false", "output.checkpoint_every=0",
       "cluster.timeout_s=240"]


def test_what_the_outsiders_providers_do_not_declare_is_refused_naming_them():
    stack = load_stack(str(EXAMPLE), [*OUTSIDER, "cluster.trainer.dp=2"])
    assert stack.engine.distribution.startswith("rlcore-example-plugin ")
    assert stack.rollout_backend.distribution.startswith("rlcore-example-plugin ")
    with pytest.raises(ConfigError) as err:
        load_stack(str(EXAMPLE), [*OUTSIDER, "cluster.trainer.tp=2"])
    assert err.value.key == "cluster.trainer.tp"
    assert "'tensor_parallel'; engine 'outsider-hf' (rlcore-example-plugin" in str(err.value)


def test_outsider_engine_and_backend_run_under_ray_with_two_ranks_and_a_replica(tmp_path):
    from rlcore.testing.runs import main
    from rlcore_ray.testing import simulated_ray_nodes

    out = tmp_path / "outsider"
    with simulated_ray_nodes(2, 2):
        assert main(["train", str(EXAMPLE), *OUTSIDER, *RUN, "cluster.trainer.dp=2", "cluster.rollout.replicas=1",
                     "--output", str(out)]) == 0
    placement = json.loads((out / "cluster.json").read_text())
    assert len(placement["trainer_ranks"]) == 2 and len(placement["rollout_replicas"]) == 1
    # three one-CPU bundles on two 2-CPU nodes: both nodes hold part of the run
    assert len({w["node"] for w in placement["trainer_ranks"] + placement["rollout_replicas"]}) == 2, placement
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert all(r["sync_verified"] and r["sync_level"] == "coverage+exact" for r in rows), rows[-1]
    assert rows[-1]["weight_version"] == STEPS
    assert rows[-1]["rollout/replica0_weight_version"] == STEPS - 1  # what the replica held at the last generate
    config = (out / "config.yaml").read_text()
    assert "name: outsider-hf" in config and "backend: outsider-local" in config
