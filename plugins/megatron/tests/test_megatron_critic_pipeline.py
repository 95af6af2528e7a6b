"""PPO's critic beside megatron pipeline stages (CPU, gloo): two stages, with and without two
virtual stages each, against one rank, through the trainer's own critic (value pass, GAE
returns, two updates over several micro-batches) and the policy's pass after it.

Tolerances, fp32 on CPU: the stages run the one-rank model's own layer operations on the same
inputs and exchange activations and their gradients exactly (send/recv, a broadcast of the
values); what may differ is the order of a few sums (the gradient norm's per-stage partial sums,
the head's added after an all-reduce), ~1e-7 relative. Values, log-probs and gradients of O(1) or
smaller are held to 1e-5, as in test_parallel.py, and so are the values after two AdamW steps
(lr 1e-2): an update is lr * m / (sqrt(v) + eps), which a 1e-7 relative change in the gradients
moves by ~1e-9 wherever |g| is not vanishing. Measured: 0.0 for every compared tensor (PP adds no
reordering inside a layer); a manual TP=2 x PP=2 run, where TP reorders the row-parallel sums,
stays within 1e-5 as well (9.4e-6 on the values after two steps). The check that the updates
moved the values by more than 1e-3 shows the comparison is not of two untrained critics."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.engine("megatron"), pytest.mark.slow]

WORKER = Path(__file__).with_name("critic_pipeline_worker.py")


@pytest.fixture(scope="module")
def one_rank(megatron_dirs, run_worker, tmp_path_factory):
    return run_worker(WORKER, megatron_dirs["dense_4l"], tmp_path_factory.mktemp("one") / "one.pt", 1, 1, world=1)


def _max_grad_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[k] - b[k]).abs().max()) for k in b)


@pytest.mark.parametrize("vpp", [2, 1], ids=["pp2-vpp2", "pp2"])
def test_critic_under_pipeline_stages_matches_a_single_rank(megatron_dirs, run_worker, one_rank, tmp_path, figures,
                                                            combinations_only_on_newest, vpp):
    """Rank 0 is the first stage, which holds neither the value head nor the final hidden states:
    its values, returns, critic metrics and gradients (every stage's, and the head's) are the
    one-rank run's, and the policy's log-probs and gradients after the critic's updates too."""
    if vpp == 1:  # PP with virtual stages is the kind that runs on every megatron-core
        combinations_only_on_newest("the critic under PP=2 without virtual stages")
    par = run_worker(WORKER, megatron_dirs["dense_4l"], tmp_path / "pp.pt", 1, 1, 2, 2, vpp)
    one = one_rank
    diffs = {k: float((par[k] - one[k]).abs().max()) for k in ("values", "returns", "after", "logprobs",
                                                              "advantage_values")}
    diffs["critic grads"] = _max_grad_diff(par["critic_grads"], one["critic_grads"])
    diffs["policy grads"] = _max_grad_diff(par["policy_grads"], one["policy_grads"])
    figures(f"critic under PP=2 (virtual stages {vpp}) vs 1 rank (dense_4l): max |d|",
            ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()))
    assert all(v < 1e-5 for v in diffs.values()), diffs
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm"):
        assert par["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5, abs=1e-7), key
    for key in ("critic/values_mean", "critic/returns_mean", "critic/explained_variance"):
        assert par["stats"][key] == pytest.approx(one["stats"][key], rel=1e-5, abs=1e-6), key
    assert par["policy_grad_norm"] == pytest.approx(one["policy_grad_norm"], rel=1e-5)
    assert float(par["critic_grads"]["value_head"].abs().max()) > 0, "the head's gradient came from the last stage"
    assert float((one["after"] - one["values"]).abs().max()) > 1e-3, "the updates moved the critic"
    assert one["metrics"]["critic/grad_norm"] > 1.0, "the critic's clip (1.0) acted on the pipelined norm"


# ------------------------------------------------ the trainer: kill and resume ------
# (no PPO learning run under PP=2: the test above holds PP=2 equal to one rank in values, returns,
# losses and gradients, so learning follows from one rank's: core/tests/test_ppo_critic.py learns,
# test_megatron_critic.py trains PPO on the megatron engine; the run below is PPO under PP=2 in the trainer)

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "megatron_tiny.yaml"
PPO_PP2 = ["algorithm.name=ppo", "megatron.pipeline_parallel_size=2", "output.progress=false",
           "output.tensorboard=false", "output.plot=false"]


def _rank_main(rank: int, world: int, port: int, out: str, errors: object, overrides: list[str], resume: bool,
               fault: str | None) -> None:
    import os

    if fault:  # rlcore.faults: this rank SIGKILLs itself at the named point
        os.environ["RLCORE_FAULT"] = fault
    try:
        from rlcore.parallel.worker import config_yaml, run_rank
        from rlcore.stack import load_stack

        stack = load_stack(str(EXAMPLE), overrides + [f"output.dir={out}"])
        run_rank(config_yaml(stack.config), rank, world, f"127.0.0.1:{port}", resume=resume)
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        errors.put(f"rank {rank}: {type(exc).__name__}: {exc}")  # type: ignore[attr-defined]
        raise
    # returns: the rank ends through the interpreter's normal shutdown, every process group released
    # by the run's teardown (test_rank_teardown.py); a -6 here is a rank that did not end cleanly


def _train_ranks(out: Path, overrides: list[str], resume: bool = False, fault_on_writer: str | None = None,
                 world: int = 2) -> tuple[list[int | None], list[str]]:
    """``world`` trainer ranks (``torch.multiprocessing`` spawn, the code the Ray actors run, without
    Ray); the writer (rank 0) gets ``RLCORE_FAULT=fault_on_writer``. Once a rank has died the
    others are given a minute to fail on the broken group, then killed. Exit codes and errors."""
    import multiprocessing as mp
    import socket
    import sys
    import time

    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # each run's ranks under a heading of their own in the captured stderr (the cut run's rank 1 prints
    # its expected "connection reset" traceback, which is no failure of the resumed run)
    print(f"--- {world} ranks: {out.name}{' (resume)' if resume else ''}"
          f"{f' RLCORE_FAULT={fault_on_writer} on rank 0' if fault_on_writer else ''}", file=sys.stderr, flush=True)
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, str(out), errors, overrides, resume,
                                                  fault_on_writer if r == 0 else None)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline and any(p.is_alive() for p in procs):
        if any(p.exitcode not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + 60)
        time.sleep(0.2)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    msgs = []
    while not errors.empty():
        msgs.append(errors.get())
    return [p.exitcode for p in procs], msgs


def test_ppo_under_pipeline_stages_killed_and_resumed_continues_the_uninterrupted_run(tmp_path, figures):
    """Two stages of two virtual stages each (a four-layer model): the writer (stage 0) is
    SIGKILLed when step 2's samples come back (rlcore.faults), the run resumes from step 1's
    per-rank shards, and its step 2 equals the uninterrupted run's exactly, policy and critic: each
    rank's shard holds only its own chunks (decoder layers 0 and 2, or 1 and 3; the embedding only
    on the first stage, the output layer only on the last) of the policy and of the critic's trunk,
    the value head and its AdamW state only on the last stage; the HF export written at the end
    (gathered from both stages by name at rank 0) holds every tensor. Bit for bit: the same
    processes on the same machine repeat the same float operations from the same state. The pipeline
    resume case of every megatron-core suite (PP with virtual stages is the kind each one runs)."""
    import json

    import torch
    from rlcore.testing.runs import read_metrics

    pp = PPO_PP2 + ["megatron.virtual_pipeline_stages=2", "engine.model.tiny.num_layers=4", "training.steps=3",
                    "data.prompts_per_step=4", "rollout.n=4", "output.checkpoint_every=1",
                    "algorithm.updates_per_step=2"]
    assert _train_ranks(tmp_path / "straight", pp) == ([0, 0], [])
    codes, _ = _train_ranks(tmp_path / "cut", pp, fault_on_writer="rollout:3")
    assert codes[0] == -9, codes  # SIGKILL; the other rank fails on the broken group or is killed
    assert [r["step"] for r in read_metrics(tmp_path / "cut")] == [0, 1]
    record = json.loads((tmp_path / "cut" / "checkpoints" / "step-00000001.json").read_text())
    layout = record["shards"]["layout"]
    assert (layout["tp"], layout["pp"], layout["vpp"], layout["dp"], layout["world"]) == (1, 2, 2, 1, 2), layout

    def shard(run: str, step: int, rank: int) -> dict:
        return torch.load(tmp_path / run / "checkpoints" / f"step-{step:08d}.rank_{rank}-of-2.pt", weights_only=True)

    policy_first, policy_last = shard("cut", 1, 0)["engine"]["model"], shard("cut", 1, 1)["engine"]["model"]
    assert len(policy_first) == len(policy_last) == 2, "two chunks of the policy per stage"
    assert any(k.startswith("embedding.") for k in policy_first[0])
    assert not any(k.startswith("output_layer.") for chunk in policy_first for k in chunk)
    assert any(k.startswith("output_layer.") for k in policy_last[1])
    assert not any(k.startswith("embedding.") for chunk in policy_last for k in chunk)
    first, last = shard("cut", 1, 0)["critic"], shard("cut", 1, 1)["critic"]
    assert len(first["trunk"]) == len(last["trunk"]) == 2, "two chunks of the critic's trunk per stage"
    assert first["head"] is None and last["head"] is not None, "the value head lives on the last stage"
    assert first["optimizer"]["state"] and last["optimizer"]["state"], "each stage's AdamW state is in its shard"

    def head_moments(critic: dict) -> list:  # AdamW's state of a [1, hidden] tensor: the value head's weight
        return [st for st in critic["optimizer"]["state"].values() if tuple(st["exp_avg"].shape) == (1, 128)]

    assert not head_moments(first) and len(head_moments(last)) == 1, "the head's AdamW state is the last stage's"

    assert _train_ranks(tmp_path / "cut", pp, resume=True) == ([0, 0], [])
    full, resumed = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "cut")
    assert [r["step"] for r in resumed] == [0, 1, 2]
    keys = ("reward_mean", "loss", "grad_norm", "critic/vf_loss", "critic/grad_norm", "critic/values_mean",
            "critic/explained_variance")
    same = {k: resumed[2][k] == full[2][k] for k in keys}
    diffs = []
    for rank in (0, 1):
        a, b = shard("cut", 2, rank), shard("straight", 2, rank)
        for part in ("engine", "critic"):
            trunk = a[part]["model" if part == "engine" else "trunk"]
            other = b[part]["model" if part == "engine" else "trunk"]
            diffs += [float((x[k] - y[k]).abs().max()) for x, y in zip(trunk, other, strict=True) for k in x
                      if torch.is_tensor(x[k]) and x[k].is_floating_point()]
        if a["critic"]["head"] is not None:
            diffs += [float((a["critic"]["head"][k] - b["critic"]["head"][k]).abs().max()) for k in a["critic"]["head"]]
    figures("PPO under PP=2 x 2 virtual stages killed at step 2 -> resume vs uninterrupted",
            f"step-2 metrics equal {same}; max |d param| (policy, critic) {max(diffs):.1e}")
    assert all(same.values()), (resumed[2], full[2])
    assert max(diffs) == 0.0
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "cut" / "model" / "model.safetensors"))
    assert {f"model.layers.{i}.mlp.down_proj.weight" for i in range(4)} <= set(exported)
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= set(exported)
