"""rlcore-megatron's tensor-, expert-, data- and pipeline-parallel ranks under Ray: the tiny GRPO on a Ray cluster of
two simulated nodes (``ray.cluster_utils.Cluster``), TP=2 on the dense tiny model and EP=2 on the
tiny MoE, DP=2 (two megatron replicas splitting the sequences) on the dense one, PP=2 with two
virtual stages each on a four-layer dense one, each with two rollout replicas, against the
single-process run of the same seed.

Why the reward curves agree within one sample per step (docs/scale.md): with
``rollout.seed_per_prompt`` the two replicas draw the samples one process draws from the same
weights; the TP/EP ranks compute the same step as one rank up to float summation order (TP: the
row-parallel all-reduce and the vocab-parallel softmax; EP: the dispatcher's sum of expert
outputs; DP: each replica's gradient sum, then the all-reduce; PP: the same operations, exact
sends), which ``tests/test_parallel.py``
bounds at 1e-5 for log-probs and gradients. The
first step's samples are drawn from the identical initial weights, so it must be equal; after
that a sample differs only where such a change moves a token's cumulative probability across its
uniform draw. Allowed: one flipped sample in a step (1/64 of its mean reward), all but one step
identical."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="the megatron suites install rlcore-ray and Ray (scripts/megatron_suite.sh)")

from rlcore.stack import load_stack  # noqa: E402
from rlcore.testing.runs import read_metrics  # noqa: E402
from rlcore_ray.testing import assert_reward_curves_agree  # noqa: E402

pytestmark = [pytest.mark.engine("megatron"), pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "megatron_tiny.yaml"
STEPS = 4
RUN = [f"training.steps={STEPS}", "data.prompts_per_step=8", "rollout.n=8", "output.progress=false",
       "output.tensorboard=false", "output.plot=false", "output.checkpoint_every=0"]
MODELS = {
    "dense": ["engine.model.tiny.num_kv_heads=2"],
    "dense4": ["engine.model.tiny.num_kv_heads=2", "engine.model.tiny.num_layers=4"],
    "moe": ["engine.model.tiny.arch=qwen3_moe", "engine.model.tiny.num_experts=4", "engine.model.tiny.topk=2",
            "engine.model.tiny.moe_intermediate_size=64"],
}
#: small buckets: a push is several buckets, at most two in flight through the object store
RAY = ["sync.bucket_mb=0.25", "plugins=[megatron,ray]", "cluster.backend=ray", "cluster.rollout.replicas=2", "cluster.timeout_s=300"]


@pytest.fixture(scope="module")
def two_nodes():
    from rlcore_ray.testing import simulated_ray_nodes

    with simulated_ray_nodes(2, 2) as cluster:
        yield cluster


@pytest.mark.parametrize("model,dim,ray_only", [("dense", "tp", []), ("moe", "ep", []), ("dense", "dp", []),
                                               ("dense4", "pp", ["megatron.virtual_pipeline_stages=2"])],
                         ids=["dense-tp", "moe-ep", "dense-dp", "dense4-pp-vpp2"])
def test_two_model_parallel_ranks_on_two_nodes_match_one_process(two_nodes, tmp_path, figures, model, dim, ray_only,
                                                                 combinations_only_on_newest):
    from rlcore.testing.runs import Trainer, main

    if dim in ("dp", "pp"):  # the rank strategies under Ray: the same code as the torchrun tests of each kind
        combinations_only_on_newest(f"{dim.upper()}=2 under Ray")
    run = RUN + MODELS[model]
    t0 = time.perf_counter()  # the command a user types (Ray is already up: the run joins it)
    assert main(["train", str(EXAMPLE), *run, *RAY, *ray_only, f"cluster.trainer.{dim}=2",
                 "--output", str(tmp_path / "ray")]) == 0
    t_ray = time.perf_counter() - t0
    t0 = time.perf_counter()
    Trainer(load_stack(str(EXAMPLE), run + ["rollout.seed_per_prompt=true", f"output.dir={tmp_path / 'one'}"])).run()
    t_one = time.perf_counter() - t0

    placement = json.loads((tmp_path / "ray" / "cluster.json").read_text())
    nodes = {w["node"] for w in placement["trainer_ranks"] + placement["rollout_replicas"]}
    assert len(placement["trainer_ranks"]) == 2 and len(placement["rollout_replicas"]) == 2
    assert len(nodes) == 2, placement

    ray_rows, one_rows = read_metrics(tmp_path / "ray"), read_metrics(tmp_path / "one")
    assert [r["step"] for r in ray_rows] == list(range(STEPS)) == [r["step"] for r in one_rows]
    a, b = assert_reward_curves_agree(ray_rows, one_rows, samples_per_step=64, identical_at_least=STEPS - 1,
                                      first_step_equal=True)
    peak = [round(r["push_peak_extra_rss_mib"], 2) for r in ray_rows]
    figures(f"Ray {dim.upper()}=2 ({model}) vs one process, {STEPS} steps of 64 samples",
            f"reward ray {[round(x, 4) for x in a]} one {[round(x, 4) for x in b]}; "
            f"push {ray_rows[-1]['sync_bytes'] / 2**20:.2f} MiB in {ray_rows[-1]['sync_buckets']} buckets of 0.25 MiB, "
            f"writer's peak extra RSS per push {peak} MiB; wall ray {t_ray:.0f} s, one {t_one:.0f} s")
    assert all(r["sync_verified"] and r["sync_level"] == "coverage+exact" for r in ray_rows)
    assert ray_rows[-1]["weight_version"] == STEPS and ray_rows[-1]["sync_buckets"] > 2
    # the export each rank gathered is the full model: as many bytes as one process pushes
    assert ray_rows[-1]["sync_bytes"] == one_rows[-1]["sync_bytes"]
    # only the writer wrote; the final checkpoint is one shard per rank plus the record
    ckpt = sorted(p.name for p in (tmp_path / "ray" / "checkpoints").iterdir())
    stem = f"step-{STEPS - 1:08d}"
    assert ckpt == [f"{stem}-hf", f"{stem}.json", f"{stem}.pt", f"{stem}.rank_0-of-2.pt", f"{stem}.rank_1-of-2.pt"], ckpt
    # the trained model as HF, gathered over both ranks: every tensor, the same as the run's end
    import torch
    from safetensors.torch import load_file

    final = load_file(str(tmp_path / "ray" / "model" / "model.safetensors"))
    at_checkpoint = load_file(str(tmp_path / "ray" / "checkpoints" / f"{stem}-hf" / "model.safetensors"))
    assert sorted(final) == sorted(at_checkpoint) and all(torch.equal(final[k], at_checkpoint[k]) for k in final)
    one_final = load_file(str(tmp_path / "one" / "model" / "model.safetensors"))
    assert sorted(final) == sorted(one_final), "the gathered export names every tensor one process exports"
    record = json.loads((tmp_path / "ray" / "checkpoints" / f"{stem}.json").read_text())
    assert record["shards"]["layout"][dim] == 2 and record["shards"]["layout"]["world"] == 2
