"""Per-rank sharded checkpoints of rlcore-megatron's tensor-parallel ranks (two gloo processes
started by ``torch.multiprocessing``, the worker code the Ray actors run, without Ray): a run that
stops after step 1 and resumes takes the same step 2 as the uninterrupted run, bit for bit; each
rank saved and loaded its own shard; a resume with another layout is refused naming the keys."""

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
    return torch.load(out / "checkpoints" / f"step-{step:08d}.rank_{rank}-of-2.pt", weights_only=True)


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
    a, b = _shard(tmp_path / "cut", 1, 0)["model"], _shard(tmp_path / "cut", 1, 1)["model"]
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
        assert resumed["model"].keys() == straight["model"].keys()
        diff = max(float((resumed["model"][k] - straight["model"][k]).abs().max()) for k in straight["model"]
                   if torch.is_tensor(straight["model"][k]) and straight["model"][k].is_floating_point())
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
