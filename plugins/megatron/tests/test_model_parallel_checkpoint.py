"""Per-rank sharded checkpoints of rlcore-megatron's tensor- and data-parallel ranks (two gloo processes
started by ``torch.multiprocessing``, the worker code the Ray actors run, without Ray): a run that
stops after step 1 and resumes takes the same step 2 as the uninterrupted run, bit for bit; each
rank saved and loaded its own shard; a resume with another layout is refused naming the keys.
Pipeline stages' shards (policy and critic, a kill and a resume): test_megatron_critic_pipeline.py."""

from __future__ import annotations

import json
import multiprocessing as mp
import socket
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.engine("megatron"), pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "megatron_tiny.yaml"
BASE = ["data.prompts_per_step=4", "rollout.n=4", "output.progress=false", "output.tensorboard=false",
        "output.plot=false", "output.checkpoint_every=0", "engine.model.tiny.num_kv_heads=2"]


def _rank_main(rank: int, world: int, port: int, out: str, errors: object, extra: list[str], resume: bool,
               allow: bool) -> None:
    try:
        from rlcore.parallel.worker import config_yaml, run_rank
        from rlcore.stack import load_stack

        stack = load_stack(str(EXAMPLE), BASE + extra + [f"output.dir={out}"])
        run_rank(config_yaml(stack.config), rank, world, f"127.0.0.1:{port}", resume=resume,
                 allow_config_change=allow)
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        errors.put(f"rank {rank}: {type(exc).__name__}: {exc}")  # type: ignore[attr-defined]
        raise


def _ranks(out: Path, world: int, extra: list[str], resume: bool = False, allow: bool = False) -> list[str]:
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, str(out), errors, extra, resume, allow))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=400)
    msgs = []
    while not errors.empty():
        msgs.append(errors.get())
    for p in procs:
        if p.is_alive():
            p.kill()
    return msgs if msgs or any(p.exitcode != 0 for p in procs) else []


def _shard(out: Path, step: int, rank: int) -> dict:
    """A rank's part of the checkpoint: ``{"engine": ..., "critic": ...}`` (the critic with ppo only)."""
    return torch.load(out / "checkpoints" / f"step-{step:08d}.rank_{rank}-of-2.pt", weights_only=True)


def _max_diff(a: dict, b: dict) -> float:
    """The largest difference between two state dicts' floating-point tensors (same keys)."""
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in b if torch.is_tensor(b[k]) and b[k].is_floating_point())


def test_tp2_shards_resume_to_the_same_step_and_refuse_another_layout(tmp_path, figures):
    tp2 = ["megatron.tensor_parallel_size=2"]
    assert _ranks(tmp_path / "straight", 2, tp2 + ["training.steps=3"]) == []
    assert _ranks(tmp_path / "cut", 2, tp2 + ["training.steps=2"]) == []
    record = json.loads((tmp_path / "cut" / "checkpoints" / "step-00000001.json").read_text())
    layout = record["shards"]["layout"]
    assert (layout["tp"], layout["ep"], layout["pp"], layout["world"]) == (2, 1, 1, 2), layout
    assert [f["file"] for f in record["shards"]["files"]] == ["step-00000001.rank_0-of-2.pt",
                                                             "step-00000001.rank_1-of-2.pt"]
    # the two ranks hold different halves of the same tensors (the last writer would have won)
    a, b = _shard(tmp_path / "cut", 1, 0)["engine"]["model"], _shard(tmp_path / "cut", 1, 1)["engine"]["model"]
    qkv = next(k for k in a if k.endswith("linear_qkv.weight"))
    assert a[qkv].shape == b[qkv].shape and not torch.equal(a[qkv], b[qkv])

    assert _ranks(tmp_path / "cut", 2, tp2 + ["training.steps=3"], resume=True) == []
    rows = {d: [json.loads(line) for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
            for d in ("straight", "cut")}
    assert [r["step"] for r in rows["cut"]] == [0, 1, 2]
    keys = ("reward_mean", "loss", "grad_norm", "entropy", "response_len")
    same = {k: rows["cut"][2][k] == rows["straight"][2][k] for k in keys}
    for rank in (0, 1):
        resumed, straight = _shard(tmp_path / "cut", 2, rank), _shard(tmp_path / "straight", 2, rank)
        diff = _max_diff(resumed["engine"]["model"], straight["engine"]["model"])
        figures(f"TP=2 save at step 1 -> resume vs uninterrupted, rank {rank}",
                f"step-2 metrics equal {same}; max |d param| after step 2: {diff:.1e}")
        assert diff == 0.0
    assert all(same.values()), (rows["cut"][2], rows["straight"][2])

    # one rank (tp=1) resuming the tp=2 shards: refused, naming the keys (the config change itself
    # is allowed here, so the layout check is what refuses)
    msgs = _ranks(tmp_path / "cut", 1, ["training.steps=4"], resume=True, allow=True)
    assert msgs and "CheckpointError" in msgs[0], msgs
    assert "tp: 2 in the checkpoint, 1 now (cluster.trainer.tp / megatron.tensor_parallel_size)" in msgs[0], msgs
    assert "world: 2 in the checkpoint, 1 now" in msgs[0], msgs


def test_dp2_shards_resume_to_the_same_step(tmp_path, figures, combinations_only_on_newest):
    """Data parallelism (two megatron ranks, TP=1: megatron's data-parallel group of 2; each rank
    runs its half of the sequences and the gradients are summed): each rank saves its own shard
    (the two replicas' are equal), the record's layout says dp=2, and a resume after step 1
    takes the uninterrupted run's step 2 exactly."""
    combinations_only_on_newest("resume of DP=2 shards")
    assert _ranks(tmp_path / "straight", 2, ["training.steps=3"]) == []
    assert _ranks(tmp_path / "cut", 2, ["training.steps=2"]) == []
    record = json.loads((tmp_path / "cut" / "checkpoints" / "step-00000001.json").read_text())
    layout = record["shards"]["layout"]
    assert (layout["tp"], layout["ep"], layout["pp"], layout["dp"], layout["world"]) == (1, 1, 1, 2, 2), layout
    a, b = _shard(tmp_path / "cut", 1, 0)["engine"], _shard(tmp_path / "cut", 1, 1)["engine"]
    assert _max_diff(a["model"], b["model"]) == 0.0, "both replicas took the same step"

    assert _ranks(tmp_path / "cut", 2, ["training.steps=3"], resume=True) == []
    rows = {d: [json.loads(line) for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
            for d in ("straight", "cut")}
    assert [r["step"] for r in rows["cut"]] == [0, 1, 2]
    keys = ("reward_mean", "loss", "grad_norm", "entropy", "response_len")
    same = {k: rows["cut"][2][k] == rows["straight"][2][k] for k in keys}
    diffs = [_max_diff(_shard(tmp_path / "cut", 2, r)["engine"]["model"],
                       _shard(tmp_path / "straight", 2, r)["engine"]["model"]) for r in (0, 1)]
    figures("DP=2 save at step 1 -> resume vs uninterrupted", f"step-2 metrics equal {same}; max |d param| {diffs}")
    assert diffs == [0.0, 0.0] and all(same.values()), (rows["cut"][2], rows["straight"][2])


def test_tp2_ppo_shards_hold_the_critic_and_resume_it(tmp_path, figures):
    """PPO's critic (a second megatron engine under the same TP layout) is in each rank's shard
    beside the policy's state: a TP=2 ppo run stopped after step 1 and resumed takes the same
    step 2 as the uninterrupted run, critic included (before, such a resume was refused)."""
    ppo = ["megatron.tensor_parallel_size=2", "algorithm.name=ppo"]
    assert _ranks(tmp_path / "straight", 2, ppo + ["training.steps=3"]) == []
    assert _ranks(tmp_path / "cut", 2, ppo + ["training.steps=2"]) == []
    state = torch.load(tmp_path / "cut" / "checkpoints" / "step-00000001.pt", weights_only=True)
    assert "critic" not in state, "the critic's shards are per rank, not in the writer's state"
    a, b = _shard(tmp_path / "cut", 1, 0)["critic"], _shard(tmp_path / "cut", 1, 1)["critic"]
    assert set(a) == {"trunk", "head", "optimizer"} and a["optimizer"] is not None
    qkv = next(k for k in a["trunk"] if k.endswith("linear_qkv.weight"))
    assert not torch.equal(a["trunk"][qkv], b["trunk"][qkv]), "each rank saved its own half of the critic's trunk"
    assert torch.equal(a["head"]["weight"], b["head"]["weight"]), "the replicated value head is the same on both"

    assert _ranks(tmp_path / "cut", 2, ppo + ["training.steps=3"], resume=True) == []
    rows = {d: [json.loads(line) for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
            for d in ("straight", "cut")}
    assert [r["step"] for r in rows["cut"]] == [0, 1, 2]
    keys = ("reward_mean", "loss", "grad_norm", "critic/vf_loss", "critic/grad_norm", "critic/values_mean")
    same = {k: rows["cut"][2][k] == rows["straight"][2][k] for k in keys}
    for rank in (0, 1):
        resumed, straight = _shard(tmp_path / "cut", 2, rank), _shard(tmp_path / "straight", 2, rank)
        # the same processes on the same machine repeat the same float operations: the resumed
        # run matches the uninterrupted one exactly, as the policy's shards do above
        diffs = {"policy": _max_diff(resumed["engine"]["model"], straight["engine"]["model"]),
                 "critic trunk": _max_diff(resumed["critic"]["trunk"], straight["critic"]["trunk"]),
                 "critic head": _max_diff(resumed["critic"]["head"], straight["critic"]["head"])}
        figures(f"TP=2 ppo save at step 1 -> resume vs uninterrupted, rank {rank}",
                f"step-2 metrics equal {same}; max |d param| after step 2: {diffs}")
        assert diffs == {"policy": 0.0, "critic trunk": 0.0, "critic head": 0.0}, diffs
    assert all(same.values()), (rows["cut"][2], rows["straight"][2])
