"""The tiny GRPO on a Ray cluster of two simulated nodes (``ray.cluster_utils.Cluster``): two
data-parallel trainer ranks (hf engine, gloo) and two rollout replicas, against the single-process
run of the same seed; a rollout replica killed mid-run is an error naming it, never a hang.

Why the reward curves must agree step for step: with ``rollout.seed_per_prompt`` every sample is
drawn from its own seed (step seed, prompt index, copy), so splitting the prompts over two
replicas draws the same samples as one process does; the two ranks' summed gradients equal the
whole batch's up to float32 summation order (test_cluster_dp.py: parameters within 1e-5 after a
step). A sample can only differ where a ~1e-6 change in the weights moves a token's cumulative
probability across its uniform draw, which is rare: the test allows one sample in a step to flip
(1/64 of a step's reward mean) and checks that most steps are identical."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import ray  # noqa: E402 - rlcore-ray depends on it
from rlcore.errors import RolloutError  # noqa: E402
from rlcore.stack import load_stack  # noqa: E402
from rlcore.testing.runs import read_metrics  # noqa: E402
from rlcore_ray.testing import assert_reward_curves_agree  # noqa: E402

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny.yaml"
STEPS = 8
RUN = [f"training.steps={STEPS}", "data.prompts_per_step=8", "rollout.n=8", "output.progress=false",
       "output.tensorboard=false", "output.plot=false", "output.checkpoint_every=0"]
#: small buckets: a push is many buckets, at most two in flight through the object store
RAY = ["sync.bucket_mb=0.25", "plugins=[ray]", "cluster.backend=ray", "cluster.trainer.dp=2", "cluster.rollout.replicas=2", "cluster.timeout_s=240"]


@pytest.fixture(scope="module")
def two_nodes():
    from rlcore_ray.testing import simulated_ray_nodes

    with simulated_ray_nodes(2, 2) as cluster:
        yield cluster


def test_two_ranks_two_replicas_on_two_nodes_match_one_process(two_nodes, tmp_path):
    from rlcore.testing.runs import Trainer, main

    t0 = time.perf_counter()  # the command a user types (Ray is already up: the run joins it)
    assert main(["train", str(EXAMPLE), *RUN, *RAY, "--output", str(tmp_path / "ray")]) == 0
    t_ray = time.perf_counter() - t0
    t0 = time.perf_counter()
    Trainer(load_stack(str(EXAMPLE), RUN + ["rollout.seed_per_prompt=true", f"output.dir={tmp_path / 'one'}"])).run()
    t_one = time.perf_counter() - t0

    placement = json.loads((tmp_path / "ray" / "cluster.json").read_text())
    nodes = {w["node"] for w in placement["trainer_ranks"] + placement["rollout_replicas"]}
    assert len(placement["trainer_ranks"]) == 2 and len(placement["rollout_replicas"]) == 2
    assert len(nodes) == 2, placement  # 4 one-CPU bundles on two 2-CPU nodes: both nodes are used

    ray_rows, one_rows = read_metrics(tmp_path / "ray"), read_metrics(tmp_path / "one")
    assert [r["step"] for r in ray_rows] == list(range(STEPS)) == [r["step"] for r in one_rows]
    a, b = assert_reward_curves_agree(ray_rows, one_rows, samples_per_step=64, identical_at_least=STEPS - 2)
    print(f"\nreward ray  {[round(x, 4) for x in a]}\nreward one  {[round(x, 4) for x in b]}\n"
          f"wall: ray {t_ray:.1f} s (cluster up, actors, {STEPS} steps), one process {t_one:.1f} s")
    assert all(r["sync_verified"] and r["sync_level"] == "coverage+exact" for r in ray_rows)
    assert ray_rows[-1]["weight_version"] == STEPS and ray_rows[-1]["sync_buckets"] > 2


def test_a_killed_replica_is_an_error_naming_it(two_nodes, tmp_path):
    from rlcore_ray.launch import train_on_ray

    stack = load_stack(str(EXAMPLE), RUN + RAY + ["training.steps=200", f"output.dir={tmp_path}"])
    outcome: dict[str, BaseException | None] = {}

    def run() -> None:
        try:
            train_on_ray(stack)
            outcome["error"] = None
        except BaseException as exc:  # noqa: BLE001 - inspected below
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 240
    while not (tmp_path / "metrics.jsonl").exists() or not read_metrics(tmp_path):
        assert time.monotonic() < deadline and thread.is_alive(), outcome
        time.sleep(0.5)
    victim = ray.get_actor(next(n for n in ray.util.list_named_actors() if n.endswith("-rollout-1")))
    os.kill(ray.get(victim.where.remote())["pid"], signal.SIGKILL)
    killed = time.monotonic()
    thread.join(timeout=120)
    assert not thread.is_alive(), "the run hangs after a replica died"
    err = outcome["error"]
    assert isinstance(err, RolloutError), repr(err)
    assert "rollout replica 1 of 2 died" in str(err)
    print(f"\nerror {time.monotonic() - killed:.1f} s after the kill: {err}")
    assert len(read_metrics(tmp_path)) < 200


class _SilentReplica:
    """A real actor that never answers (a replica stuck in a kernel, or a wedged node)."""

    def generate(self, prompts, params):
        time.sleep(3600)


def test_a_silent_replica_times_out(two_nodes):
    from rlcore.types import Prompt, SamplingSettings
    from rlcore_ray.fleet import RolloutFleet

    silent = ray.remote(_SilentReplica).options(num_cpus=0).remote()
    try:
        fleet = RolloutFleet([silent], timeout_s=2)
        t0 = time.monotonic()
        with pytest.raises(RolloutError, match=r"replica 0 of 1 did not answer generate within cluster.rollout.timeout_s=2"):
            fleet.generate([Prompt(ids=[1, 2], index=0)], SamplingSettings(n=1, temperature=1.0, max_new_tokens=2))
        assert time.monotonic() - t0 < 30
    finally:
        ray.kill(silent)


#: the writer lends its parameters to replicas on its machine: both ranks and both replicas in one
#: node's bundles (half a CPU each, so the four fit the 2-CPU simulated node)
MAPPED = ["sync.name=mapped", "cluster.placement=colocated", "cluster.trainer.resources.num_cpus=0.5",
          "cluster.rollout.resources.num_cpus=0.5"]


def test_mapped_sync_lends_the_writers_parameters_to_colocated_replicas(two_nodes, tmp_path):
    """``sync.name=mapped``: every push is one copy per replica straight out of the writer's
    parameters (moved into shared memory at the first push), no bucket, no object store; the
    replicas hold exactly what was lent (coverage+exact) and the run draws the same samples as
    the single-process run (same tolerance as above)."""
    from rlcore.testing.runs import Trainer, main

    out = tmp_path / "mapped"
    assert main(["train", str(EXAMPLE), *RUN, *RAY, *MAPPED, "ray.strategy=STRICT_PACK", "--output", str(out)]) == 0
    Trainer(load_stack(str(EXAMPLE), RUN + ["rollout.seed_per_prompt=true", f"output.dir={tmp_path / 'one'}"])).run()
    placement = json.loads((out / "cluster.json").read_text())
    assert len({w["node"] for w in placement["trainer_ranks"] + placement["rollout_replicas"]}) == 1, placement
    rows, one = read_metrics(out), read_metrics(tmp_path / "one")
    a, b = assert_reward_curves_agree(rows, one, samples_per_step=64, identical_at_least=STEPS - 2)
    print(f"\nreward mapped {[round(x, 4) for x in a]}\nreward one    {[round(x, 4) for x in b]}\n"
          f"push ms {[round(1e3 * r['sync_seconds'], 1) for r in rows]}")
    assert all(r["sync_verified"] and r["sync_level"] == "coverage+exact" and r["sync_buckets"] == 0
               for r in rows), rows[-1]  # no bucket: the inproc run above sends several per push
    assert rows[-1]["weight_version"] == STEPS


def test_mapped_sync_refuses_a_replica_on_another_node(two_nodes, tmp_path):
    """Storages cannot be mapped across hosts: with the ranks spread over the two nodes, replica 1
    (colocated with rank 1) is on the other node, and the first push says so."""
    from rlcore_ray.launch import train_on_ray

    stack = load_stack(str(EXAMPLE), RUN + RAY + MAPPED + ["ray.strategy=STRICT_SPREAD", f"output.dir={tmp_path}"])
    with pytest.raises(Exception, match=r"rollout replica 1 runs on Ray node .* parameters can be lent only on one machine"):
        train_on_ray(stack)


def test_mapped_sync_outside_a_colocated_ray_cluster_is_a_config_error():
    """Decided by the sync's declared lends_storage capability: one process has no replica to lend
    to (the local launcher), and under Ray the replicas must be colocated."""
    from rlcore.errors import ConfigError

    with pytest.raises(ConfigError, match=r"sync.name 'mapped' \(rlcore-ray .*\) lends .* cluster.backend=local") as err:
        load_stack(str(EXAMPLE), ["plugins=[ray]", "sync.name=mapped"])
    assert err.value.key == "sync.name"
    with pytest.raises(ConfigError, match=r"set cluster.placement=colocated") as err:
        load_stack(str(EXAMPLE), [*RAY, "sync.name=mapped"])
    assert err.value.key == "cluster.placement"
