"""The overlapped loop with rollout replicas as Ray actors (docs/async.md), on simulated nodes.

A Ray actor runs one call at a time: a push sent while a replica generates must not wait for the
whole generate (the trainer waits for the push before it takes the next samples: a deadlock in
the making). Replicas generate on a thread of their own (``submit``/``collect``), so the push
lands within a collect's wait; the local rollout inside resumes its rows on the new weights.
A replica SIGKILLed mid-push, with a request in flight, is an error naming it on both sides,
never a hang. And the modes train through the fleet: ``one_step_off`` with two replicas."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import ray
from rlcore.errors import RolloutError, WeightSyncError
from rlcore.stack import config_yaml, load_stack
from rlcore.testing.conformance import hf_export
from rlcore.types import Prompt, SamplingSettings
from rlcore.weight_sync import InprocSync
from rlcore_ray.fleet import RolloutFleet, RolloutReplica

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny.yaml"
#: greedy from this prompt, the tiny model (dense_a) does not stop within 400 tokens: seconds of generate
PROMPTS = [Prompt(ids=[8, 9], index=0)]
LONG = SamplingSettings(n=64, temperature=0.0, max_new_tokens=400, seed=3)  # 64 rows: each token costs more


@pytest.fixture(scope="module")
def one_node():
    from rlcore_ray.testing import simulated_ray_nodes

    with simulated_ray_nodes(1, 2) as cluster:
        yield cluster


def _fleet(tmp_path, model_dir) -> tuple[RolloutFleet, object]:
    text = config_yaml(load_stack(str(EXAMPLE), [f"output.dir={tmp_path}"]))
    replica = ray.remote(RolloutReplica).options(num_cpus=0).remote(text, 0, str(tmp_path))
    fleet = RolloutFleet([replica], timeout_s=120)
    fleet.start(str(model_dir), version=0)
    return fleet, replica


def _generate_in_background(fleet) -> tuple[threading.Thread, dict]:
    got: dict = {}

    def run() -> None:
        try:
            got["samples"] = fleet.generate(PROMPTS, LONG)
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            got["error"] = exc
        got["done_at"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    time.sleep(0.3)  # the request is in flight in the replica
    return thread, got


def test_a_push_is_not_stuck_behind_a_long_generate(one_node, tmp_path, tiny_model_dirs):
    fleet, replica = _fleet(tmp_path, tiny_model_dirs["dense_a"])
    try:
        assert fleet.resumes_in_flight()
        thread, got = _generate_in_background(fleet)
        assert thread.is_alive(), f"generate finished before the push: make it longer ({got})"
        t0 = time.monotonic()
        InprocSync(bucket_bytes=64 * 1024).push(hf_export(tiny_model_dirs["dense_b"]), fleet, 1)
        pushed_at = time.monotonic()
        thread.join(180)
        assert not thread.is_alive() and "error" not in got, got.get("error")
        assert pushed_at < got["done_at"], "the push waited for the generate call"
        print(f"\npush took {pushed_at - t0:.2f} s with a request in flight; generate ended "
              f"{got['done_at'] - pushed_at:.2f} s later")
        resumed = [s for s in got["samples"] if s.weight_versions]
        assert resumed and all(s.weight_versions[0] == (0, 0) and s.weight_versions[1][0] == 1 for s in resumed)
        assert fleet.replica_versions() == [1]
    finally:
        ray.kill(replica)


def test_a_replica_killed_mid_push_with_a_request_in_flight_is_an_error_naming_it(one_node, tmp_path,
                                                                                   tiny_model_dirs):
    fleet, replica = _fleet(tmp_path, tiny_model_dirs["dense_a"])
    thread, got = _generate_in_background(fleet)
    weights = iter(hf_export(tiny_model_dirs["dense_b"]))

    def killing(stream):  # the replica dies once the push has started sending
        for n, item in enumerate(stream):
            if n == 1:
                os.kill(ray.get(replica.where.remote())["pid"], signal.SIGKILL)
            yield item

    t0 = time.monotonic()
    with pytest.raises((RolloutError, WeightSyncError), match="rollout replica 0 of 1"):
        InprocSync(bucket_bytes=4 * 1024).push(killing(weights), fleet, 1)
    thread.join(60)
    assert not thread.is_alive(), "the generate in flight hangs after its replica died"
    assert isinstance(got.get("error"), RolloutError) and "rollout replica 0 of 1 died" in str(got["error"])
    assert time.monotonic() - t0 < 60


def test_one_step_off_trains_through_the_fleet(one_node, tmp_path):
    from rlcore.testing.runs import main, read_metrics

    out = tmp_path / "run"
    assert main(["train", str(EXAMPLE), "--output", str(out), "training.steps=4", "data.prompts_per_step=4",
                 "rollout.n=4", "output.progress=false", "output.tensorboard=false", "output.plot=false",
                 "output.checkpoint_every=0", "plugins=[ray]", "cluster.backend=ray", "cluster.rollout.replicas=2",
                 "cluster.timeout_s=240", "cluster.trainer.resources.num_cpus=0.5",
                 "cluster.rollout.resources.num_cpus=0.5", "loop.mode=one_step_off"]) == 0
    rows = read_metrics(out)
    assert [r["loop/staleness_max"] for r in rows] == [0, 1, 1, 1]
    assert rows[-1]["weight_version"] == 4 and all(r["sync_verified"] for r in rows)
